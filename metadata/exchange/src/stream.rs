//! The connections of the metadata plane: plain TCP, or TLS over it (cargo feature
//! `tls`, `tls.rs`), and the TLS settings. Every part that speaks on a socket (the
//! TCPStore client and server, the P2P listener and client) does so through [`Stream`],
//! so TLS is one branch here and nowhere else.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
#[cfg(feature = "tls")]
use std::sync::Arc;
use std::time::Duration;

use ferry_storage::Error;

/// Mutual TLS settings (PEM files, read at start): this side presents `cert` (as a
/// server) or `client_cert` (as a client; `cert` when unset) and checks the other
/// side's certificate against `ca_cert`.
#[derive(Clone, Debug)]
pub struct TlsConfig {
    /// The CA certificate(s) the other side's certificate must chain to.
    pub ca_cert: PathBuf,
    /// This side's certificate chain (as a server; as a client too unless
    /// `client_cert` is set).
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// This side's certificate as a client, when it differs (certificates whose
    /// extended key usage allows only one role).
    pub client_cert: Option<PathBuf>,
    /// Its key.
    pub client_key: Option<PathBuf>,
    /// The name the server's certificate must carry; unset: the address or host name
    /// connected to.
    pub server_name: Option<String>,
}

impl TlsConfig {
    /// Settings with `ca_cert`, `cert` and `key`, the rest unset.
    pub fn new(
        ca_cert: impl Into<PathBuf>,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> TlsConfig {
        TlsConfig {
            ca_cert: ca_cert.into(),
            cert: cert.into(),
            key: key.into(),
            client_cert: None,
            client_key: None,
            server_name: None,
        }
    }
}

/// Loaded TLS settings, shared by the connections of a server or client.
#[derive(Clone)]
pub struct TlsContext {
    #[cfg(feature = "tls")]
    inner: Arc<crate::tls::Tls>,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsContext")
    }
}

impl TlsContext {
    /// Read the files of `config` (a missing or bad file is an `InvalidParam` error
    /// naming it); `NotSupported` without the `tls` cargo feature.
    pub fn load(config: &TlsConfig) -> Result<TlsContext, Error> {
        #[cfg(feature = "tls")]
        {
            Ok(TlsContext {
                inner: Arc::new(crate::tls::Tls::load(config)?),
            })
        }
        #[cfg(not(feature = "tls"))]
        {
            let _ = config;
            Err(Error::NotSupported {
                backend: "exchange".into(),
                what: "TLS: this build of ferry-exchange lacks its `tls` cargo feature".into(),
            })
        }
    }

    /// The server side of a TLS connection on `sock`.
    pub(crate) fn accept(&self, sock: TcpStream) -> io::Result<Stream> {
        #[cfg(feature = "tls")]
        {
            self.inner.accept(sock).map(Stream::Tls)
        }
        #[cfg(not(feature = "tls"))]
        {
            let _ = sock;
            Err(io::Error::other("TLS is not built in"))
        }
    }

    /// The client side of a TLS connection on `sock` to `host`.
    pub(crate) fn connect(&self, sock: TcpStream, host: &str) -> io::Result<Stream> {
        #[cfg(feature = "tls")]
        {
            self.inner.connect(sock, host).map(Stream::Tls)
        }
        #[cfg(not(feature = "tls"))]
        {
            let _ = (sock, host);
            Err(io::Error::other("TLS is not built in"))
        }
    }
}

/// `tls`, loaded, if set.
pub(crate) fn load(tls: Option<&TlsConfig>) -> Result<Option<TlsContext>, Error> {
    tls.map(TlsContext::load).transpose()
}

/// A connection of the metadata plane: plain TCP, or TLS over it.
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS (feature `tls`).
    #[cfg(feature = "tls")]
    Tls(crate::tls::TlsStream),
}

impl Stream {
    /// The TCP socket under it.
    pub fn socket(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            #[cfg(feature = "tls")]
            Stream::Tls(t) => t.socket(),
        }
    }

    /// Another handle of the same connection.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Plain(s) => Stream::Plain(s.try_clone()?),
            #[cfg(feature = "tls")]
            Stream::Tls(t) => Stream::Tls(t.try_clone()?),
        })
    }

    /// Bound the next reads (on the socket).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.socket().set_read_timeout(t)
    }

    /// Bound the next writes (on the socket).
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.socket().set_write_timeout(t)
    }

    /// Shut the socket down (wakes a blocked reader).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.socket().shutdown(how)
    }

    /// The other side's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.socket().peer_addr()
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(t) => t.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write_vectored(bufs),
            #[cfg(feature = "tls")]
            Stream::Tls(t) => t.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            #[cfg(feature = "tls")]
            Stream::Tls(t) => t.flush(),
        }
    }
}
