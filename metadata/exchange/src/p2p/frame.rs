//! The P2P wire format: a hello on connect, then length-prefixed frames.
//!
//! ```text
//! hello (each side, once):  "FRYX" | version u8 | auth u8 (0/1) | nonce [16]
//! frame:  body_len u32 LE | body
//! body:   kind u8 | seq u64 LE | name_len u8 | name | label_len u8 | label
//!         | payload ... | mac [32] (only when authenticated)
//! ```
//! `seq` counts the frames one side sent on the connection, from 0; the receiver
//! refuses any other value, so a frame can be neither replayed nor reordered. With a
//! shared secret, `mac` = HMAC-SHA256(secret, receiver's nonce ‖ body_len ‖ body
//! without mac): a frame recorded on one connection is worthless on another, since
//! each receiver picks a fresh random nonce.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::util::nonzero;

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 4] = *b"FRYX";
const VERSION: u8 = 1;
const HELLO_LEN: usize = 4 + 1 + 1 + 16;
const MAC_LEN: usize = 32;
/// kind + seq + name_len + label_len.
const FIXED_LEN: usize = 1 + 8 + 1 + 1;

/// What a frame asks or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// "Load this metadata": the payload is the sender's metadata under `label`.
    Load = 1,
    /// "Send me yours": the receiver answers with a `Load` of its metadata under `label`.
    SendMe = 2,
    /// "Invalidate me": the receiver drops the sender's metadata.
    Invalidate = 3,
    /// Positive answer to `Load` and `Invalidate`.
    Ack = 4,
    /// Negative answer; the payload is a UTF-8 reason.
    Error = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Load,
            2 => Kind::SendMe,
            3 => Kind::Invalidate,
            4 => Kind::Ack,
            5 => Kind::Error,
            _ => return None,
        })
    }
}

/// A received frame, borrowing the connection's read buffer.
#[derive(Debug)]
pub struct Frame<'a> {
    /// What it is.
    pub kind: Kind,
    /// The sender's agent name.
    pub name: &'a str,
    /// The metadata label.
    pub label: &'a str,
    /// The payload.
    pub payload: &'a [u8],
}

/// Why a frame could not be received.
#[derive(Debug)]
pub enum RecvError {
    /// The other side closed the connection between frames.
    Closed,
    /// A socket error or timeout.
    Io(io::Error),
    /// The frame breaks the protocol (oversized, malformed, unauthenticated, out of
    /// sequence); the connection cannot go on.
    Refused(String),
}

impl std::fmt::Display for RecvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecvError::Closed => f.write_str("connection closed"),
            RecvError::Io(e) => write!(f, "{e}"),
            RecvError::Refused(why) => write!(f, "frame refused: {why}"),
        }
    }
}

/// One connection after the hello exchange.
pub struct FramedConn {
    stream: TcpStream,
    secret: Option<Arc<[u8]>>,
    my_nonce: [u8; 16],
    peer_nonce: [u8; 16],
    send_seq: u64,
    recv_seq: u64,
    max_frame_bytes: usize,
    io_timeout: Duration,
    read_buf: Vec<u8>,
    write_buf: Vec<u8>,
}

impl FramedConn {
    /// Exchange hellos on a fresh connection. Both sides must agree on authentication.
    pub fn handshake(
        mut stream: TcpStream,
        secret: Option<Arc<[u8]>>,
        max_frame_bytes: usize,
        io_timeout: Duration,
    ) -> Result<FramedConn, RecvError> {
        let my_nonce = crate::util::nonce().map_err(|e| RecvError::Refused(e.to_string()))?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(&MAGIC);
        hello[4] = VERSION;
        hello[5] = u8::from(secret.is_some());
        hello[6..].copy_from_slice(&my_nonce);
        stream
            .set_read_timeout(Some(nonzero(io_timeout)))
            .map_err(RecvError::Io)?;
        stream
            .set_write_timeout(Some(nonzero(io_timeout)))
            .map_err(RecvError::Io)?;
        stream.write_all(&hello).map_err(RecvError::Io)?;
        let mut peer = [0u8; HELLO_LEN];
        stream.read_exact(&mut peer).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => RecvError::Closed,
            _ => RecvError::Io(e),
        })?;
        if peer[..4] != MAGIC {
            return Err(RecvError::Refused("not a Ferry P2P hello".into()));
        }
        if peer[4] != VERSION {
            return Err(RecvError::Refused(format!(
                "protocol version {} (this side speaks {VERSION})",
                peer[4]
            )));
        }
        match (peer[5], secret.is_some()) {
            (0, true) => {
                return Err(RecvError::Refused(
                    "peer does not authenticate, this side requires a shared secret".into(),
                ))
            }
            (1, false) => {
                return Err(RecvError::Refused(
                    "peer requires authentication, this side has no shared secret".into(),
                ))
            }
            (0, false) | (1, true) => {}
            (other, _) => return Err(RecvError::Refused(format!("auth mode {other}"))),
        }
        let mut peer_nonce = [0u8; 16];
        peer_nonce.copy_from_slice(&peer[6..]);
        Ok(FramedConn {
            stream,
            secret,
            my_nonce,
            peer_nonce,
            send_seq: 0,
            recv_seq: 0,
            max_frame_bytes,
            io_timeout,
            read_buf: Vec::new(),
            write_buf: Vec::new(),
        })
    }

    /// The socket (for its addresses and shutdown).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Send one frame. A frame over the size limit is refused before anything is sent.
    pub fn send(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
        let mac_len = if self.secret.is_some() { MAC_LEN } else { 0 };
        let body_len = FIXED_LEN + name.len() + label.len() + payload.len() + mac_len;
        if body_len > self.max_frame_bytes || name.len() > 255 || label.len() > 255 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "frame of {body_len} bytes is over the limit of {} bytes (or a name or label is over 255 bytes)",
                    self.max_frame_bytes
                ),
            ));
        }
        let buf = &mut self.write_buf;
        buf.clear();
        buf.extend_from_slice(&(body_len as u32).to_le_bytes());
        buf.push(kind as u8);
        buf.extend_from_slice(&self.send_seq.to_le_bytes());
        buf.push(name.len() as u8);
        buf.extend_from_slice(name.as_bytes());
        buf.push(label.len() as u8);
        buf.extend_from_slice(label.as_bytes());
        buf.extend_from_slice(payload);
        if let Some(secret) = &self.secret {
            let tag = mac(secret, &self.peer_nonce, buf)?;
            buf.extend_from_slice(&tag);
        }
        self.stream.write_all(buf)?;
        self.send_seq += 1;
        Ok(())
    }

    /// Receive one frame, waiting at most `first_byte_timeout` for it to start (then
    /// the I/O timeout for the rest).
    pub fn recv(&mut self, first_byte_timeout: Duration) -> Result<Frame<'_>, RecvError> {
        let mut len = [0u8; 4];
        self.stream
            .set_read_timeout(Some(nonzero(first_byte_timeout)))
            .map_err(RecvError::Io)?;
        loop {
            match self.stream.read(&mut len[..1]) {
                Ok(0) => return Err(RecvError::Closed),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RecvError::Io(e)),
            }
        }
        self.stream
            .set_read_timeout(Some(nonzero(self.io_timeout)))
            .map_err(RecvError::Io)?;
        self.stream
            .read_exact(&mut len[1..])
            .map_err(RecvError::Io)?;
        let body_len = u32::from_le_bytes(len) as usize;
        let mac_len = if self.secret.is_some() { MAC_LEN } else { 0 };
        if body_len > self.max_frame_bytes {
            return Err(RecvError::Refused(format!(
                "frame of {body_len} bytes is over the limit of {} bytes",
                self.max_frame_bytes
            )));
        }
        if body_len < FIXED_LEN + mac_len {
            return Err(RecvError::Refused(format!(
                "frame of {body_len} bytes is too short"
            )));
        }
        self.read_buf.clear();
        self.read_buf.extend_from_slice(&len);
        self.read_buf.resize(4 + body_len, 0);
        self.stream
            .read_exact(&mut self.read_buf[4..])
            .map_err(RecvError::Io)?;
        let (signed, tag) = self.read_buf.split_at(4 + body_len - mac_len);
        if let Some(secret) = &self.secret {
            verify(secret, &self.my_nonce, signed, tag)
                .map_err(|()| RecvError::Refused("authentication tag does not match".into()))?;
        }
        let frame = parse(&signed[4..]).map_err(RecvError::Refused)?;
        if frame.1 != self.recv_seq {
            return Err(RecvError::Refused(format!(
                "sequence number {} where {} was due",
                frame.1, self.recv_seq
            )));
        }
        self.recv_seq += 1;
        Ok(frame.0)
    }
}

/// Parse a body without its mac: (frame, seq).
fn parse(body: &[u8]) -> Result<(Frame<'_>, u64), String> {
    let kind = Kind::from_u8(body[0]).ok_or_else(|| format!("unknown frame kind {}", body[0]))?;
    let seq = u64::from_le_bytes(body[1..9].try_into().map_err(|_| "short frame")?);
    let mut rest = &body[9..];
    let mut text = |what: &str| -> Result<&str, String> {
        let (&n, tail) = rest
            .split_first()
            .ok_or_else(|| format!("no {what} length"))?;
        if tail.len() < n as usize {
            return Err(format!("{what} runs past the frame"));
        }
        let (s, tail) = tail.split_at(n as usize);
        rest = tail;
        std::str::from_utf8(s).map_err(|_| format!("{what} is not UTF-8"))
    };
    let name = text("name")?;
    let label = text("label")?;
    Ok((
        Frame {
            kind,
            name,
            label,
            payload: rest,
        },
        seq,
    ))
}

fn hmac_over(secret: &[u8], nonce: &[u8; 16], data: &[u8]) -> Result<HmacSha256, io::Error> {
    let mut m = HmacSha256::new_from_slice(secret)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    m.update(nonce);
    m.update(data);
    Ok(m)
}

fn mac(secret: &[u8], nonce: &[u8; 16], data: &[u8]) -> io::Result<[u8; MAC_LEN]> {
    Ok(hmac_over(secret, nonce, data)?
        .finalize()
        .into_bytes()
        .into())
}

fn verify(secret: &[u8], nonce: &[u8; 16], data: &[u8], tag: &[u8]) -> Result<(), ()> {
    // Constant-time comparison inside `verify_slice`.
    hmac_over(secret, nonce, data)
        .map_err(|_| ())?
        .verify_slice(tag)
        .map_err(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(
        a: Option<&[u8]>,
        b: Option<&[u8]>,
    ) -> (Result<FramedConn, RecvError>, Result<FramedConn, RecvError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let b = b.map(Arc::from);
        let t = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            FramedConn::handshake(s, b, 4096, Duration::from_secs(2))
        });
        let s = TcpStream::connect(addr).unwrap();
        let a = FramedConn::handshake(s, a.map(Arc::from), 4096, Duration::from_secs(2));
        (a, t.join().unwrap())
    }

    #[test]
    fn frames_round_trip_with_and_without_auth() {
        for secret in [None, Some(&b"s3cret"[..])] {
            let (a, b) = pair(secret, secret);
            let (mut a, mut b) = (a.unwrap(), b.unwrap());
            for i in 0..3u8 {
                a.send(Kind::Load, "agent-a", "metadata", &[i; 10]).unwrap();
                let f = b.recv(Duration::from_secs(2)).unwrap();
                assert_eq!(
                    (f.kind, f.name, f.label, f.payload),
                    (Kind::Load, "agent-a", "metadata", &[i; 10][..])
                );
            }
            b.send(Kind::Ack, "agent-b", "", &[]).unwrap();
            let f = a.recv(Duration::from_secs(2)).unwrap();
            assert_eq!(f.kind, Kind::Ack);
        }
    }

    #[test]
    fn auth_mismatch_and_wrong_secret_are_refused() {
        let (a, b) = pair(Some(b"x"), None);
        assert!(matches!(a, Err(RecvError::Refused(_))));
        assert!(matches!(b, Err(RecvError::Refused(_))));
        let (a, b) = pair(Some(b"x"), Some(b"y"));
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        a.send(Kind::Invalidate, "a", "", &[]).unwrap();
        assert!(
            matches!(b.recv(Duration::from_secs(2)), Err(RecvError::Refused(r)) if r.contains("authentication"))
        );
    }

    #[test]
    fn oversized_frames_are_refused_on_both_sides() {
        let (a, b) = pair(None, None);
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        assert!(a.send(Kind::Load, "a", "metadata", &[0; 5000]).is_err());
        // A hostile sender that ignores the limit.
        a.stream.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        assert!(
            matches!(b.recv(Duration::from_secs(2)), Err(RecvError::Refused(r)) if r.contains("over the limit"))
        );
    }

    #[test]
    fn parse_rejects_truncated_fields() {
        assert!(parse(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 5, b'a']).is_err());
        assert!(parse(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        let (f, seq) = parse(&[2, 7, 0, 0, 0, 0, 0, 0, 0, 1, b'a', 0]).unwrap();
        assert_eq!((f.kind, f.name, f.label, seq), (Kind::SendMe, "a", "", 7));
    }
}
