//! The direct GET path of the TCPStore backend: fetches written by the caller's thread.
//!
//! One connection to the store, made by the fetch worker after its first successful
//! fetch, with a **reader thread** blocked on it. A fetch finds it idle (nothing
//! pending), writes its GET there from the caller's thread — a small request into an
//! empty send buffer, so it never waits on the network — and the reader, already
//! waiting, reads the reply: a value is loaded (and its key watched), an empty reply
//! (missing key) hands the fetch to the fetch worker, which waits for the key. So a
//! fetch of published metadata costs one round trip and no worker wake-up.
//!
//! A connection that fails hands its pending fetches to the fetch worker (which
//! retries on its own connection) and is made again by the worker on a later fetch.
//! Against servers that close the connection on a GET of a missing key (torch's legacy
//! server) the worker turns this path off for good.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ferry_storage::Error;

use crate::contract::{DirectFetch, Shared, StoreCmd};
use crate::events::{Event, Route};
use crate::stream::Stream;
use crate::tcpstore::proto::{self, op};
use crate::tcpstore::{user_key, ClientOptions, TcpStoreClient};
use crate::util::{io_error, is_timeout, lock};

const BACKEND: &str = "tcpstore";

/// (agent, wire key) of fetched peers, checked for deletion by the fetch worker.
pub(crate) type Watched = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Most peers watched at once (each costs two keys in every watch round).
pub(crate) const WATCHED_MAX: usize = 4096;

/// Watch `agent` under `key` (once per agent; past [`WATCHED_MAX`] not at all, with a
/// warning: its withdrawal then goes unseen until it is fetched again).
pub(crate) fn watch_peer(watched: &Mutex<Vec<(String, Vec<u8>)>>, agent: &str, key: &[u8]) {
    let mut watched = lock(watched);
    if watched.iter().any(|(a, _)| a == agent) {
        return;
    }
    if watched.len() >= WATCHED_MAX {
        log::warn!("tcpstore: {WATCHED_MAX} peers watched; '{agent}' is not watched");
        return;
    }
    watched.push((agent.to_owned(), key.to_vec()));
}

/// A GET written and not yet answered.
struct Pending {
    agent: String,
    label: String,
    key: Vec<u8>,
    sent_at: Instant,
}

#[derive(Default)]
struct PendingQueue {
    gets: VecDeque<Pending>,
    /// The reader closed the connection: nothing may be added.
    closed: bool,
}

/// One direct connection.
struct Conn {
    /// The socket and the request being built.
    writer: Mutex<(Stream, Vec<u8>)>,
    pending: Mutex<PendingQueue>,
    /// A clone of the socket, to shut it down without the writer lock.
    socket: TcpStream,
}

/// The direct path, shared by the manager (callers), the fetch worker and the readers.
pub(crate) struct Direct {
    shared: Arc<Shared>,
    endpoint: String,
    /// The connection, when one is up. `stopped` lives under the same lock.
    conn: Mutex<(Option<Arc<Conn>>, bool)>,
    /// Off for good against servers that close on a GET of a missing key.
    enabled: AtomicBool,
    /// The fetch worker's queue, for fetches this path cannot finish; taken at stop.
    fetches: Mutex<Option<SyncSender<StoreCmd>>>,
    watched: Watched,
    readers: Mutex<Vec<JoinHandle<()>>>,
}

impl Direct {
    pub(crate) fn new(
        shared: Arc<Shared>,
        endpoint: String,
        fetches: SyncSender<StoreCmd>,
        watched: Watched,
    ) -> Direct {
        Direct {
            shared,
            endpoint,
            conn: Mutex::new((None, false)),
            enabled: AtomicBool::new(true),
            fetches: Mutex::new(Some(fetches)),
            watched,
            readers: Mutex::new(Vec::new()),
        }
    }

    /// Write a GET of `agent`'s metadata under `label` on the idle direct connection;
    /// `false` (nothing written) when there is none or it is busy: queue the fetch for
    /// the worker then. Never waits: the writer lock is only tried.
    pub(crate) fn try_fetch(&self, agent: &str, label: &str) -> bool {
        if !self.enabled.load(Ordering::Acquire) {
            return false;
        }
        let Some(conn) = lock(&self.conn).0.clone() else {
            return false;
        };
        let Ok(mut writer) = conn.writer.try_lock() else {
            return false;
        };
        let key = user_key(&self.shared.key(agent, label)).into_bytes();
        let (stream, request) = &mut *writer;
        request.clear();
        request.push(op::GET);
        proto::put_bytes(request, &key);
        {
            // Only writers (holding the writer lock) add to the queue: an empty queue
            // means an empty send buffer, so the request fits at once.
            let mut pending = lock(&conn.pending);
            if pending.closed || !pending.gets.is_empty() {
                return false;
            }
            pending.gets.push_back(Pending {
                agent: agent.to_owned(),
                label: label.to_owned(),
                key,
                sent_at: Instant::now(),
            });
        }
        if stream.write_all(request).is_err() {
            // The reader sees the shutdown and hands the fetch to the worker.
            let _unused = conn.socket.shutdown(Shutdown::Both);
        }
        self.shared.direct_fetches.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Whether the fetch worker should make a connection (enabled, none up).
    pub(crate) fn wants_connection(&self) -> bool {
        let conn = lock(&self.conn);
        self.enabled.load(Ordering::Acquire) && conn.0.is_none() && !conn.1
    }

    /// Make the direct connection and start its reader (fetch worker only: this waits
    /// on the network).
    pub(crate) fn connect(self: &Arc<Self>, options: &ClientOptions) -> Result<(), Error> {
        let client = TcpStoreClient::connect(&self.endpoint, options.clone())?;
        let stream = client.into_stream();
        let reader_stream = stream
            .try_clone()
            .map_err(|e| io_error(BACKEND, "cloning the direct connection", &e))?;
        let socket = stream
            .socket()
            .try_clone()
            .map_err(|e| io_error(BACKEND, "cloning the direct connection", &e))?;
        let conn = Arc::new(Conn {
            writer: Mutex::new((stream, Vec::with_capacity(256))),
            pending: Mutex::new(PendingQueue::default()),
            socket,
        });
        let mut slot = lock(&self.conn);
        if slot.1 || !self.enabled.load(Ordering::Acquire) {
            return Ok(());
        }
        let spawned = {
            let (direct, conn) = (self.clone(), conn.clone());
            let max_value_bytes = options.max_value_bytes;
            std::thread::Builder::new()
                .name(format!("ferry-tcpstore-direct-{}", self.shared.agent))
                .spawn(move || direct.read_loop(&conn, reader_stream, max_value_bytes))
                .map_err(|e| io_error(BACKEND, "spawning the direct reader", &e))?
        };
        slot.0 = Some(conn);
        drop(slot);
        let mut readers = lock(&self.readers);
        readers.retain(|t| !t.is_finished());
        readers.push(spawned);
        Ok(())
    }

    /// Turn the path off for good (the server closes on a GET of a missing key).
    pub(crate) fn disable(&self) {
        self.enabled.store(false, Ordering::Release);
        if let Some(conn) = lock(&self.conn).0.take() {
            let _unused = conn.socket.shutdown(Shutdown::Both);
        }
    }

    /// Close the connection and join the readers (the manager raised the stop flag).
    pub(crate) fn stop(&self) {
        {
            let mut slot = lock(&self.conn);
            slot.1 = true;
            if let Some(conn) = slot.0.take() {
                let _unused = conn.socket.shutdown(Shutdown::Both);
            }
        }
        drop(lock(&self.fetches).take());
        let readers = std::mem::take(&mut *lock(&self.readers));
        for r in readers {
            let _unused = r.join();
        }
    }

    /// Hand a fetch to the worker: `missing` (the GET found nothing: wait for the key)
    /// or not (the connection failed: start over).
    fn hand_over(&self, p: Pending, missing: bool) {
        if self.shared.stopping() {
            return;
        }
        let cmd = if missing {
            StoreCmd::WaitFor {
                agent: p.agent,
                label: p.label,
                since: p.sent_at,
            }
        } else {
            StoreCmd::Fetch {
                agent: p.agent,
                label: p.label,
            }
        };
        let fetches = lock(&self.fetches);
        let Some(tx) = fetches.as_ref() else {
            return;
        };
        let cmd = match tx.try_send(cmd) {
            Ok(()) => return,
            Err(TrySendError::Full(cmd) | TrySendError::Disconnected(cmd)) => cmd,
        };
        drop(fetches);
        if let StoreCmd::Fetch { agent, label } | StoreCmd::WaitFor { agent, label, .. } = cmd {
            self.shared.emit(Event::FetchFailed {
                agent,
                label,
                error: Error::Capacity {
                    what: "tcpstore fetch queue",
                    limit: self.shared.config.command_capacity,
                },
            });
        }
    }

    /// Read GET replies until the connection fails or the manager stops; then close it
    /// and hand what is pending to the worker.
    fn read_loop(&self, conn: &Arc<Conn>, stream: Stream, max_value_bytes: usize) {
        let io_timeout = self.shared.config.io_timeout;
        let mut reader = BufReader::with_capacity(16 << 10, stream);
        loop {
            // Wait for a reply to start; a timeout here leaves the stream in step.
            match reader.fill_buf() {
                Ok([]) => break,
                Ok(_) => {}
                Err(e) if is_timeout(&e) => {
                    if self.shared.stopping() {
                        break;
                    }
                    let overdue = lock(&conn.pending)
                        .gets
                        .front()
                        .is_some_and(|p| p.sent_at.elapsed() >= io_timeout);
                    if overdue {
                        log::warn!("tcpstore: no GET reply from {} in time", self.endpoint);
                        break;
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            let value = match read_value(&mut reader, max_value_bytes) {
                Ok(v) => v,
                Err(_) => break,
            };
            let Some(p) = lock(&conn.pending).gets.pop_front() else {
                log::warn!("tcpstore: unsolicited reply from {}", self.endpoint);
                break;
            };
            if value.is_empty() {
                // Ferry never publishes an empty value: the key is missing.
                self.hand_over(p, true);
                continue;
            }
            watch_peer(&self.watched, &p.agent, &p.key);
            self.shared.emit(Event::Load {
                agent: p.agent,
                label: p.label,
                blob: value,
                route: Route::TcpStore,
            });
        }
        {
            let mut slot = lock(&self.conn);
            if slot.0.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                slot.0 = None;
            }
        }
        let _unused = conn.socket.shutdown(Shutdown::Both);
        let pending = {
            let mut pending = lock(&conn.pending);
            pending.closed = true;
            std::mem::take(&mut pending.gets)
        };
        for p in pending {
            self.hand_over(p, false);
        }
    }
}

impl DirectFetch for Direct {
    fn try_fetch(&self, agent: &str, label: &str) -> bool {
        Direct::try_fetch(self, agent, label)
    }

    fn stop(&self) {
        Direct::stop(self);
    }
}

/// Read a GET reply (a length, then the value): what is buffered is copied, the rest of
/// a long value is read straight from the socket into the value (not through the
/// buffer: one copy, and reads as large as the socket has data for).
fn read_value(reader: &mut BufReader<Stream>, max_len_bytes: usize) -> std::io::Result<Vec<u8>> {
    let len = proto::read_u64(reader)?;
    if len > max_len_bytes as u64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("length {len} is over the limit of {max_len_bytes} bytes"),
        ));
    }
    let len = len as usize;
    // Reserved as the bytes arrive (`read_to_end` doubles), not at the announced
    // length: a store that announces 256 MiB and sends nothing costs 64 KiB.
    let mut value = Vec::with_capacity(len.min(64 << 10));
    let buffered = reader.buffer();
    let n = buffered.len().min(len);
    value.extend_from_slice(&buffered[..n]);
    reader.consume(n);
    if value.len() < len {
        let rest = (len - value.len()) as u64;
        reader.get_mut().take(rest).read_to_end(&mut value)?;
    }
    if value.len() != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed inside a value",
        ));
    }
    Ok(value)
}
