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

use std::io::{self, IoSlice, Read, Write};
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

/// A received frame.
#[derive(Debug)]
pub struct Frame {
    /// What it is.
    pub kind: Kind,
    /// The sender's agent name.
    pub name: String,
    /// The metadata label.
    pub label: String,
    /// The payload (read straight into its own buffer, not copied out of another).
    pub payload: Vec<u8>,
}

/// Why a frame could not be received.
#[derive(Debug)]
pub enum RecvError {
    /// The other side closed the connection between frames.
    Closed,
    /// No frame started within the first-byte timeout; the connection is still usable.
    Idle,
    /// A socket error or timeout (inside a frame: the connection cannot go on).
    Io(io::Error),
    /// The frame breaks the protocol (oversized, malformed, unauthenticated, out of
    /// sequence); the connection cannot go on.
    Refused(String),
}

impl std::fmt::Display for RecvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecvError::Closed => f.write_str("connection closed"),
            RecvError::Idle => f.write_str("no frame within the timeout"),
            RecvError::Io(e) => write!(f, "{e}"),
            RecvError::Refused(why) => write!(f, "frame refused: {why}"),
        }
    }
}

/// One connection after the hello exchange: a [`FrameWriter`] and a [`FrameReader`] on
/// the same socket, usable together or split for two threads ([`Self::into_split`]).
pub struct FramedConn {
    writer: FrameWriter,
    reader: FrameReader,
}

/// The sending half of a connection.
pub struct FrameWriter {
    stream: TcpStream,
    secret: Option<Arc<[u8]>>,
    peer_nonce: [u8; 16],
    send_seq: u64,
    max_frame_bytes: usize,
    /// The frame being sent: its length prefix and header, and the payload and tag too
    /// when the payload is short (then one `write` sends it all).
    write_buf: Vec<u8>,
    /// Whether `write_buf` holds the payload (and tag) too.
    inline: bool,
    /// The tag of the frame being sent, when it is not inline.
    tag: Option<[u8; MAC_LEN]>,
}

/// The receiving half of a connection.
pub struct FrameReader {
    stream: TcpStream,
    secret: Option<Arc<[u8]>>,
    my_nonce: [u8; 16],
    recv_seq: u64,
    max_frame_bytes: usize,
    io_timeout: Duration,
    /// The read timeout now set on the socket (changed only before a read that needs
    /// another one, so a frame that arrives whole costs no `setsockopt`).
    read_timeout: Duration,
    /// Bytes read ahead: `read_buf[read_pos..read_end]` are unconsumed.
    read_buf: Box<[u8]>,
    read_pos: usize,
    read_end: usize,
}

/// Size of the read-ahead buffer; frame headers (at most 11 + 255 + 255 bytes) always
/// fit, payloads beyond it are read straight into their own buffer.
const READ_AHEAD_BYTES: usize = 16 << 10;
/// Payloads at least this long are written from the caller's buffer (with `writev`),
/// not copied.
const WRITE_COPY_MAX_BYTES: usize = 16 << 10;

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
        let write_stream = stream.try_clone().map_err(RecvError::Io)?;
        Ok(FramedConn {
            writer: FrameWriter {
                stream: write_stream,
                secret: secret.clone(),
                peer_nonce,
                send_seq: 0,
                max_frame_bytes,
                write_buf: Vec::new(),
                inline: true,
                tag: None,
            },
            reader: FrameReader {
                stream,
                secret,
                my_nonce,
                recv_seq: 0,
                max_frame_bytes,
                io_timeout,
                read_timeout: nonzero(io_timeout),
                read_buf: vec![0u8; READ_AHEAD_BYTES].into_boxed_slice(),
                read_pos: 0,
                read_end: 0,
            },
        })
    }

    /// The socket (for its addresses and shutdown).
    pub fn stream(&self) -> &TcpStream {
        &self.reader.stream
    }

    /// Send one frame (see [`FrameWriter::send`]).
    pub fn send(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
        self.writer.send(kind, name, label, payload)
    }

    /// Receive one frame (see [`FrameReader::recv`]).
    pub fn recv(&mut self, first_byte_timeout: Duration) -> Result<Frame, RecvError> {
        self.reader.recv(first_byte_timeout)
    }

    /// The two halves, for a writing and a reading thread.
    pub fn into_split(self) -> (FrameWriter, FrameReader) {
        (self.writer, self.reader)
    }
}

impl FrameWriter {
    /// The socket (for shutdown).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Send one frame. A frame over the size limit is refused before anything is sent.
    pub fn send(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
        self.start(kind, name, label, payload)?;
        self.finish(payload)
    }

    /// Encode a frame without sending it: the size checks (an `InvalidInput` error for
    /// a frame over the limit), the header and the tag. [`Self::finish`] sends it; a
    /// writer whose encoded frame is not sent must be abandoned (the frame used up its
    /// sequence number).
    pub fn start(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
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
        let tag = match &self.secret {
            Some(secret) => {
                let mut m = hmac_start(secret, &self.peer_nonce)?;
                m.update(buf);
                m.update(payload);
                Some(<[u8; MAC_LEN]>::from(m.finalize().into_bytes()))
            }
            None => None,
        };
        self.inline = payload.len() < WRITE_COPY_MAX_BYTES;
        if self.inline {
            buf.extend_from_slice(payload);
            buf.extend_from_slice(tag.as_ref().map_or(&[][..], |t| &t[..]));
            self.tag = None;
        } else {
            self.tag = tag;
        }
        // The sequence number is spent once encoded: a frame that fails half-sent
        // leaves the connection unusable anyway.
        self.send_seq += 1;
        Ok(())
    }

    /// Send the frame encoded by [`Self::start`] (`payload` is the same one), in one
    /// `write` (short payloads) or one `writev` (long ones, uncopied).
    pub fn finish(&mut self, payload: &[u8]) -> io::Result<()> {
        if self.inline {
            return self.stream.write_all(&self.write_buf);
        }
        let tag = self.tag.take();
        let mut slices = [
            IoSlice::new(&self.write_buf),
            IoSlice::new(payload),
            IoSlice::new(tag.as_ref().map_or(&[][..], |t| &t[..])),
        ];
        write_all_vectored(&mut self.stream, &mut slices)
    }
}

/// `write_all` over several buffers, with as few `writev` calls as the socket allows.
fn write_all_vectored(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the socket accepted no bytes",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl FrameReader {
    /// The socket (for shutdown).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    fn set_read_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        let timeout = nonzero(timeout);
        if timeout != self.read_timeout {
            self.stream.set_read_timeout(Some(timeout))?;
            self.read_timeout = timeout;
        }
        Ok(())
    }

    /// Make at least `n` (<= READ_AHEAD_BYTES) unconsumed bytes available.
    fn fill(&mut self, n: usize) -> Result<(), RecvError> {
        if self.read_end - self.read_pos >= n {
            return Ok(());
        }
        if self.read_pos + n > self.read_buf.len() {
            self.read_buf.copy_within(self.read_pos..self.read_end, 0);
            self.read_end -= self.read_pos;
            self.read_pos = 0;
        }
        self.set_read_timeout(self.io_timeout)
            .map_err(RecvError::Io)?;
        while self.read_end - self.read_pos < n {
            match self.stream.read(&mut self.read_buf[self.read_end..]) {
                Ok(0) => {
                    return Err(RecvError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a frame",
                    )))
                }
                Ok(got) => self.read_end += got,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RecvError::Io(e)),
            }
        }
        Ok(())
    }

    /// Take `out.len()` bytes: first what was read ahead, then straight from the socket.
    fn take_into(&mut self, out: &mut [u8]) -> Result<(), RecvError> {
        let ahead = (self.read_end - self.read_pos).min(out.len());
        out[..ahead].copy_from_slice(&self.read_buf[self.read_pos..self.read_pos + ahead]);
        self.read_pos += ahead;
        if ahead == out.len() {
            return Ok(());
        }
        self.set_read_timeout(self.io_timeout)
            .map_err(RecvError::Io)?;
        self.stream
            .read_exact(&mut out[ahead..])
            .map_err(RecvError::Io)
    }

    /// Receive one frame, waiting at most `first_byte_timeout` for it to start (then
    /// the I/O timeout for the rest). [`RecvError::Idle`] when none started: the
    /// connection is still usable.
    pub fn recv(&mut self, first_byte_timeout: Duration) -> Result<Frame, RecvError> {
        if self.read_pos == self.read_end {
            self.read_pos = 0;
            self.read_end = 0;
            self.set_read_timeout(first_byte_timeout)
                .map_err(RecvError::Io)?;
            loop {
                match self.stream.read(&mut self.read_buf[..]) {
                    Ok(0) => return Err(RecvError::Closed),
                    Ok(got) => {
                        self.read_end = got;
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if crate::util::is_timeout(&e) => return Err(RecvError::Idle),
                    Err(e) => return Err(RecvError::Io(e)),
                }
            }
        }
        self.fill(4)?;
        let len_bytes: [u8; 4] = [
            self.read_buf[self.read_pos],
            self.read_buf[self.read_pos + 1],
            self.read_buf[self.read_pos + 2],
            self.read_buf[self.read_pos + 3],
        ];
        let body_len = u32::from_le_bytes(len_bytes) as usize;
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
        // The header: everything up to the payload, all within the read-ahead buffer.
        let signed_len = body_len - mac_len;
        self.fill(4 + signed_len.min(FIXED_LEN + 2 * 255))?;
        let start = self.read_pos + 4;
        let window = &self.read_buf[start..self.read_end.min(start + signed_len)];
        let header = parse_header(window, signed_len).map_err(RecvError::Refused)?;
        let mut mac = match &self.secret {
            Some(secret) => {
                let mut m = hmac_start(secret, &self.my_nonce).map_err(RecvError::Io)?;
                m.update(&self.read_buf[self.read_pos..start + header.len]);
                Some(m)
            }
            None => None,
        };
        self.read_pos = start + header.len;
        let mut payload = vec![0u8; signed_len - header.len];
        self.take_into(&mut payload)?;
        if let Some(mut m) = mac.take() {
            m.update(&payload);
            let mut tag = [0u8; MAC_LEN];
            self.take_into(&mut tag)?;
            // Constant-time comparison inside `verify_slice`.
            m.verify_slice(&tag)
                .map_err(|_| RecvError::Refused("authentication tag does not match".into()))?;
        }
        if header.seq != self.recv_seq {
            return Err(RecvError::Refused(format!(
                "sequence number {} where {} was due",
                header.seq, self.recv_seq
            )));
        }
        self.recv_seq += 1;
        Ok(Frame {
            kind: header.kind,
            name: header.name,
            label: header.label,
            payload,
        })
    }
}

struct Header {
    kind: Kind,
    seq: u64,
    name: String,
    label: String,
    /// Bytes of the body before the payload.
    len: usize,
}

/// Parse the start of a body (`window`, of a body whose signed part is `signed_len`
/// bytes long).
fn parse_header(window: &[u8], signed_len: usize) -> Result<Header, String> {
    let raw = parse(window)?;
    if raw.len > signed_len {
        return Err("header runs past the frame".into());
    }
    Ok(Header {
        kind: raw.kind,
        seq: raw.seq,
        name: raw.name.to_owned(),
        label: raw.label.to_owned(),
        len: raw.len,
    })
}

/// The header at the start of a body, borrowing it.
#[derive(Debug, PartialEq)]
struct RawHeader<'a> {
    kind: Kind,
    name: &'a str,
    label: &'a str,
    seq: u64,
    /// Bytes of the body before the payload.
    len: usize,
}

/// Parse the header at the start of `body`.
fn parse(body: &[u8]) -> Result<RawHeader<'_>, String> {
    if body.len() < FIXED_LEN {
        return Err("short frame".into());
    }
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
    let len = body.len() - rest.len();
    Ok(RawHeader {
        kind,
        name,
        label,
        seq,
        len,
    })
}

fn hmac_start(secret: &[u8], nonce: &[u8; 16]) -> io::Result<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    m.update(nonce);
    Ok(m)
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
            FramedConn::handshake(s, b, 1 << 20, Duration::from_secs(2))
        });
        let s = TcpStream::connect(addr).unwrap();
        let a = FramedConn::handshake(s, a.map(Arc::from), 1 << 20, Duration::from_secs(2));
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
                    (f.kind, &*f.name, &*f.label, &f.payload[..]),
                    (Kind::Load, "agent-a", "metadata", &[i; 10][..])
                );
            }
            // Large payloads (read past the read-ahead buffer, written uncopied), and
            // frames sent back to back (read ahead together).
            let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
            a.send(Kind::Load, "agent-a", "big", &big).unwrap();
            a.send(Kind::Invalidate, "agent-a", "", &[]).unwrap();
            let f = b.recv(Duration::from_secs(2)).unwrap();
            assert_eq!((&*f.label, f.payload == big), ("big", true));
            assert_eq!(
                b.recv(Duration::from_secs(2)).unwrap().kind,
                Kind::Invalidate
            );
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
        assert!(a
            .send(Kind::Load, "a", "metadata", &vec![0; 2 << 20])
            .is_err());
        // A hostile sender that ignores the limit.
        a.writer
            .stream
            .write_all(&(1u32 << 30).to_le_bytes())
            .unwrap();
        assert!(
            matches!(b.recv(Duration::from_secs(2)), Err(RecvError::Refused(r)) if r.contains("over the limit"))
        );
    }

    #[test]
    fn parse_rejects_truncated_fields() {
        assert!(parse(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 5, b'a']).is_err());
        assert!(parse(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        let h = parse(&[2, 7, 0, 0, 0, 0, 0, 0, 0, 1, b'a', 0, 9, 9]).unwrap();
        assert_eq!(
            h,
            RawHeader {
                kind: Kind::SendMe,
                name: "a",
                label: "",
                seq: 7,
                len: 12
            }
        );
    }
}
