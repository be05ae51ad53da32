//! Peers: endpoints (created lazily, closed on unload), remote keys.

use super::*;

pub(super) struct PeerState {
    pub(super) name: String,
    pub(super) worker: usize,
    pub(super) remote_address: Vec<u8>,
    pub(super) ep: ucp_ep_h,
    pub(super) link: Box<PeerLink>,
    pub(super) regions: Arc<dyn PeerRegions>,
    pub(super) rkeys: HashMap<u64, ucp_rkey_h>,
    /// Set once UCX reported the endpoint dead; cleared by a reload with new info.
    pub(super) down: Option<ucs_status_t>,
    pub(super) transports: String,
}

impl Core {
    pub(crate) fn load_remote(
        &mut self,
        peer: PeerId,
        name: &str,
        addresses: Option<Vec<Vec<u8>>>,
        regions: Arc<dyn PeerRegions>,
    ) -> Result<()> {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.regions = regions;
            state.name.clear();
            state.name.push_str(name);
            if let Some(addresses) = addresses {
                let remote = addresses[state.worker % addresses.len()].clone();
                if remote != state.remote_address {
                    // The peer restarted (or moved): forget its endpoint and rkeys.
                    self.teardown_peer(peer);
                    let state = self.peers.get_mut(&peer).expect("present");
                    state.remote_address = remote;
                    state.down = None;
                    state.link.status.store(0, Ordering::Release);
                }
            }
            return Ok(());
        }
        let addresses = addresses.ok_or_else(|| Error::InvalidMetadata {
            reason: format!("UCX: first metadata of peer '{name}' has no connection info").into(),
        })?;
        let worker = self.next_worker % self.workers.len();
        self.next_worker += 1;
        let remote_address = addresses[worker % addresses.len()].clone();
        self.peers.insert(
            peer,
            PeerState {
                name: name.to_string(),
                worker,
                remote_address,
                ep: ptr::null_mut(),
                link: Box::new(PeerLink {
                    events: Arc::as_ptr(&self.events),
                    status: AtomicI8::new(0),
                }),
                regions,
                rkeys: HashMap::new(),
                down: None,
                transports: String::new(),
            },
        );
        Ok(())
    }

    /// Close the peer's endpoint (in-flight requests to it fail) and drop its rkeys.
    pub(super) fn teardown_peer(&mut self, peer: PeerId) {
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        let ep = std::mem::replace(&mut state.ep, ptr::null_mut());
        let worker = self.workers[state.worker].handle;
        let rkeys: Vec<ucp_rkey_h> = state.rkeys.drain().map(|(_, r)| r).collect();
        if !ep.is_null() {
            self.close_ep(worker, ep);
        }
        let api = self.ucp.api();
        for rkey in rkeys {
            // SAFETY: rkeys unpacked on the now-closed ep; nothing uses them any more.
            unsafe { api.ucp_rkey_destroy(rkey) };
        }
    }

    pub(crate) fn unload_remote(&mut self, peer: PeerId) {
        if !self.peers.contains_key(&peer) {
            return;
        }
        self.teardown_peer(peer);
        self.peers.remove(&peer);
        // Callbacks of the canceled requests have been queued; turn them into
        // completions now (they map to RemoteDisconnect: the peer is gone).
        self.handle_events();
    }

    pub(crate) fn disconnect(&mut self, peer: PeerId) -> Result<()> {
        if !self.peers.contains_key(&peer) {
            return Err(Error::not_found(Subject::Peer(peer)));
        }
        self.teardown_peer(peer);
        self.handle_events();
        Ok(())
    }

    /// Force-close `ep` and progress until UCX confirms (bounded by a timeout).
    pub(super) fn close_ep(&mut self, worker: ucp_worker_h, ep: ucp_ep_h) {
        let api = self.ucp.api();
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: ep is live and owned by us; param valid for the call.
        let request = unsafe { api.ucp_ep_close_nbx(ep, &param) };
        if ucs_ptr_is_ptr(request) {
            let deadline = Instant::now() + EP_CLOSE_TIMEOUT;
            loop {
                // SAFETY: worker is live; request is the close request we own.
                let status = unsafe {
                    api.ucp_worker_progress(worker);
                    api.ucp_request_check_status(request)
                };
                if status != ucs_status_t::UCS_INPROGRESS {
                    break;
                }
                if Instant::now() > deadline {
                    log::warn!("UCX: endpoint close did not finish within {EP_CLOSE_TIMEOUT:?}");
                    break;
                }
            }
            // SAFETY: we own the close request; freeing an unfinished one lets UCX release
            // it when done.
            unsafe { api.ucp_request_free(request) };
        }
    }

    pub(super) fn create_ep(
        &self,
        worker: usize,
        address: &[u8],
        link: Option<&PeerLink>,
    ) -> Result<ucp_ep_h> {
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
        params.address = address.as_ptr() as *const ucp_address_t;
        if let (Some(link), ErrorMode::Peer) = (link, self.err_mode) {
            params.field_mask |=
                u64::from(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
            params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: link as *const PeerLink as *mut c_void,
            };
        }
        let mut ep: ucp_ep_h = ptr::null_mut();
        // SAFETY: worker live; the address bytes are valid for the call (UCX copies what
        // it needs); the error handler arg outlives the ep (owned by the peer state).
        let status = unsafe { api.ucp_ep_create(self.workers[worker].handle, &params, &mut ep) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_ep_create", status));
        }
        Ok(ep)
    }

    /// The endpoint to `peer`, created on first use.
    pub(super) fn peer_ep(&mut self, peer: PeerId) -> Result<(ucp_ep_h, usize)> {
        let state = self
            .peers
            .get(&peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        if state.down.is_some() {
            return Err(Error::RemoteDisconnect {
                subject: Subject::PeerName(state.name.clone()),
            });
        }
        if !state.ep.is_null() {
            return Ok((state.ep, state.worker));
        }
        let worker = state.worker;
        let ep = self.create_ep(worker, &state.remote_address, Some(&state.link))?;
        let transports = self.ep_transports(ep);
        let state = self.peers.get_mut(&peer).expect("present");
        log::info!(
            "UCX {}: endpoint to '{}' on worker {worker} uses {transports}",
            self.ucp.version(),
            state.name
        );
        state.ep = ep;
        state.transports = transports;
        Ok((ep, worker))
    }

    pub(super) fn local_ep(&mut self) -> Result<ucp_ep_h> {
        if self.self_ep.is_null() {
            let address = self.workers[0].address.clone();
            self.self_ep = self.create_ep(0, &address, None)?;
            log::info!(
                "UCX {}: local endpoint uses {}",
                self.ucp.version(),
                self.ep_transports(self.self_ep)
            );
        }
        Ok(self.self_ep)
    }

    pub(crate) fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.peer_ep(peer).map(|_| ())
    }

    pub(super) fn rkey_for(
        &mut self,
        endpoint: Endpoint,
        ep: ucp_ep_h,
        token: u64,
    ) -> Result<ucp_rkey_h> {
        let api = self.ucp.api();
        match endpoint {
            Endpoint::Local => {
                let index = self
                    .mem_index(token)
                    .ok_or_else(|| Error::not_found(token_subject(token)))?;
                let entry = self.mems[index].as_mut().expect("checked");
                if entry.self_rkey.is_null() {
                    let mut rkey: ucp_rkey_h = ptr::null_mut();
                    // SAFETY: ep live; packed bytes from our own ucp_rkey_pack.
                    let status = unsafe {
                        api.ucp_ep_rkey_unpack(
                            ep,
                            entry.packed_rkey.as_ptr() as *const c_void,
                            &mut rkey,
                        )
                    };
                    if !status.is_ok() {
                        return Err(ucx_error(&self.ucp, "ucp_ep_rkey_unpack (local)", status));
                    }
                    entry.self_rkey = rkey;
                }
                Ok(entry.self_rkey)
            }
            Endpoint::Peer(peer) => {
                let state = self.peers.get_mut(&peer).expect("peer_ep checked");
                if let Some(&rkey) = state.rkeys.get(&token) {
                    return Ok(rkey);
                }
                let packed = state.regions.public_md(token).ok_or_else(|| {
                    Error::not_found(Subject::Named(
                        format!("region token {token:#x} of peer '{}'", state.name).into(),
                    ))
                })?;
                let packed =
                    crate::wire::unframe_rkey(packed).map_err(|why| Error::InvalidMetadata {
                        reason: format!(
                            "UCX rkey of region token {token:#x} of peer '{}': {why}",
                            state.name
                        )
                        .into(),
                    })?;
                let mut rkey: ucp_rkey_h = ptr::null_mut();
                // SAFETY: ep live; UCX parses the packed rkey (peer bytes) and reports
                // malformed input as an error status.
                let status = unsafe {
                    api.ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey)
                };
                if !status.is_ok() {
                    return Err(Error::InvalidMetadata {
                        reason: format!(
                            "UCX rkey of region token {token:#x} of peer '{}': {}",
                            state.name,
                            self.ucp.status_string(status)
                        )
                        .into(),
                    });
                }
                state.rkeys.insert(token, rkey);
                Ok(rkey)
            }
        }
    }
}
