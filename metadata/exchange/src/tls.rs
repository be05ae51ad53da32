//! TLS for the metadata plane (cargo feature `tls`: rustls with the ring provider, the
//! crates the `etcd-tls` feature already brings): mutual TLS on the TCPStore server and
//! client and on the P2P listener and client.
//!
//! Both servers and the P2P client read a connection on one thread while others write
//! to it (a TCPStore wake-up is written by the setter's thread; P2P requests by callers
//! and lanes while a reader waits for replies). rustls keeps one state per connection,
//! so [`TlsStream`] shares it: the session lives under a mutex; a reader reads
//! ciphertext from the socket *outside* the lock and hands it to the session, a writer
//! encrypts and sends under the lock. Clones of a `TlsStream` are the halves.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::sync::{Arc, Mutex};

use ferry_storage::{Error, Subject};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::stream::TlsConfig;
use crate::util::lock;

/// Loaded TLS settings: both sides' rustls configurations.
pub(crate) struct Tls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

fn bad(what: &str, path: &std::path::Path, e: impl std::fmt::Display) -> Error {
    Error::invalid(
        Subject::Named(format!("TLS {what} '{}'", path.display()).into()),
        format!("cannot be used: {e}"),
    )
}

fn certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad("certificate file", path, e))?
        .collect();
    let certs = certs.map_err(|e| bad("certificate file", path, e))?;
    if certs.is_empty() {
        return Err(bad("certificate file", path, "no certificate in it"));
    }
    Ok(certs)
}

fn key(path: &std::path::Path) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| bad("key file", path, e))
}

impl Tls {
    /// Read the files of `config` and build both sides' configurations (mutual TLS:
    /// each side presents a certificate signed by `ca_cert` and checks the other's).
    pub(crate) fn load(config: &TlsConfig) -> Result<Tls, Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for ca in certs(&config.ca_cert)? {
            roots
                .add(ca)
                .map_err(|e| bad("CA certificate", &config.ca_cert, e))?;
        }
        let roots = Arc::new(roots);
        let tls_error = |what: &str, e: rustls::Error| {
            Error::invalid(Subject::Named(format!("TLS {what}").into()), e.to_string())
        };
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| Error::invalid(Subject::Named("TLS client verifier".into()), e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("protocol versions", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs(&config.cert)?, key(&config.key)?)
            .map_err(|e| tls_error("server certificate", e))?;
        let (client_cert, client_key) = match (&config.client_cert, &config.client_key) {
            (Some(c), Some(k)) => (c, k),
            _ => (&config.cert, &config.key),
        };
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("protocol versions", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs(client_cert)?, key(client_key)?)
            .map_err(|e| tls_error("client certificate", e))?;
        let server_name = match &config.server_name {
            Some(name) => Some(ServerName::try_from(name.clone()).map_err(|e| {
                Error::invalid(
                    Subject::Named(format!("TLS server name '{name}'").into()),
                    e.to_string(),
                )
            })?),
            None => None,
        };
        Ok(Tls {
            server: Arc::new(server),
            client: Arc::new(client),
            server_name,
        })
    }

    /// The server side of a TLS connection on `sock` (handshake done, within the
    /// socket's timeouts).
    pub(crate) fn accept(&self, sock: TcpStream) -> io::Result<TlsStream> {
        let conn = rustls::ServerConnection::new(self.server.clone()).map_err(other)?;
        TlsStream::handshake(rustls::Connection::Server(conn), sock)
    }

    /// The client side of a TLS connection on `sock` to `host` (the configured server
    /// name when there is one, else the address or host name connected to).
    pub(crate) fn connect(&self, sock: TcpStream, host: &str) -> io::Result<TlsStream> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => match host.parse::<IpAddr>() {
                Ok(ip) => ServerName::IpAddress(ip.into()),
                Err(_) => ServerName::try_from(host.to_owned()).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("TLS name '{host}': {e}"),
                    )
                })?,
            },
        };
        let conn = rustls::ClientConnection::new(self.client.clone(), name).map_err(other)?;
        TlsStream::handshake(rustls::Connection::Client(conn), sock)
    }
}

fn other(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

/// One TLS connection whose session is shared by its clones (module docs).
pub struct TlsStream {
    session: Arc<Mutex<rustls::Connection>>,
    sock: TcpStream,
    /// Ciphertext read from the socket and not yet taken by the session.
    pending: Vec<u8>,
}

impl TlsStream {
    fn handshake(mut conn: rustls::Connection, mut sock: TcpStream) -> io::Result<TlsStream> {
        while conn.is_handshaking() {
            let (read, wrote) = conn.complete_io(&mut sock)?;
            if read == 0 && wrote == 0 && conn.is_handshaking() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "TLS handshake: the other side closed the connection",
                ));
            }
        }
        // Flush what the handshake left to send (a TLS 1.3 server's tickets).
        while conn.wants_write() {
            conn.write_tls(&mut sock)?;
        }
        Ok(TlsStream {
            session: Arc::new(Mutex::new(conn)),
            sock,
            pending: Vec::new(),
        })
    }

    /// Another handle of the same connection (a reader or writer half).
    pub(crate) fn try_clone(&self) -> io::Result<TlsStream> {
        Ok(TlsStream {
            session: self.session.clone(),
            sock: self.sock.try_clone()?,
            pending: Vec::new(),
        })
    }

    /// The socket under the session.
    pub(crate) fn socket(&self) -> &TcpStream {
        &self.sock
    }

    fn feed(&mut self, session: &mut rustls::Connection) -> io::Result<()> {
        let mut rd = &self.pending[..];
        while !rd.is_empty() {
            match session.read_tls(&mut rd) {
                Ok(0) => break,
                Ok(_) => {}
                // The session's plaintext buffer is full: the rest waits for the reader.
                Err(e) if e.kind() == io::ErrorKind::Other => break,
                Err(e) => return Err(e),
            }
            session.process_new_packets().map_err(other)?;
        }
        let used = self.pending.len() - rd.len();
        self.pending.drain(..used);
        while session.wants_write() {
            session.write_tls(&mut &self.sock)?;
        }
        Ok(())
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut chunk = [0u8; 16 << 10];
        loop {
            {
                let session = self.session.clone();
                let mut session = lock(&session);
                if !self.pending.is_empty() {
                    self.feed(&mut session)?;
                }
                match session.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            // Outside the lock: writers go on while this waits for bytes.
            let n = (&self.sock).read(&mut chunk)?;
            let session = self.session.clone();
            let mut session = lock(&session);
            if n == 0 {
                // End of the socket: the session turns it into EOF (after a
                // close_notify) or an UnexpectedEof error.
                session.read_tls(&mut &[][..])?;
                session.process_new_packets().map_err(other)?;
                return match session.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    r => r,
                };
            }
            self.pending.extend_from_slice(&chunk[..n]);
            self.feed(&mut session)?;
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut session = lock(&self.session);
        let n = session.writer().write(buf)?;
        while session.wants_write() {
            session.write_tls(&mut &self.sock)?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut session = lock(&self.session);
        while session.wants_write() {
            session.write_tls(&mut &self.sock)?;
        }
        Ok(())
    }
}
