//! The P2P wire format: a hello (with a mutual challenge–response when a shared secret
//! is set), then length-prefixed frames.
//!
//! ```text
//! hello (each side, once):  "FRYX" | version u8 (2) | auth u8 (0/1) | nonce [16]
//!                           | name_len u8 | name          (the sender's agent name)
//! proof (each side, once, only with a secret, after reading the other's hello):
//!         HMAC-SHA256(secret, "ferry-p2p-v2 proof" | role u8 | own nonce | peer nonce
//!                     | own name_len | own name | peer name_len | peer name)   [32]
//! frame:  body_len u32 LE | head | head_tag [32]? | payload | tag [32]?
//! head:   kind u8 | seq u64 LE | name_len u8 | name | label_len u8 | label
//! ```
//!
//! **Identity.** Each side names itself in its hello; every frame's `name` must be the
//! name its sender gave in the hello, else the frame is refused. With a shared secret
//! the name is *proven*: the proof binds both nonces, both names and the sender's role
//! (connecting or accepting side), so it cannot be replayed on another connection,
//! reflected back to its sender (the role differs; a hello that echoes the receiver's
//! own nonce is refused too) or moved to another name. Without a secret the name is
//! only *claimed*: anyone who can connect can claim any name.
//!
//! **Authentication before allocation.** With a secret, `head_tag` =
//! HMAC(secret, receiver's nonce | "H" | body_len | head) is checked before a byte of
//! the payload is read, so an unauthenticated peer never gets the receiver to allocate
//! more than a read-ahead buffer; `tag` = HMAC(secret, receiver's nonce | "B" | body_len
//! | head | payload) covers the whole frame. Each receiver picks a fresh nonce, so a
//! frame recorded on one connection (or direction) is worthless on another. The hello
//! is at most [`HELLO_MAX_BYTES`]; nothing before the proofs is larger.
//!
//! **Bounded reads.** A frame over `max_frame_bytes` is refused from its length prefix.
//! The payload is read into a buffer that grows with the bytes that actually arrived
//! (doubling from [`PAYLOAD_FIRST_CHUNK_BYTES`]), never reserved at the announced size;
//! so a peer costs the receiver at most about twice what it really sent. A frame (and
//! the hello) must arrive within a deadline: the I/O timeout plus one second per MiB of
//! body ([`MIN_RATE_BYTES_PER_S`]), so a sender that trickles bytes cannot hold a
//! connection forever.
//!
//! `seq` counts the frames one side sent on the connection, from 0; the receiver
//! refuses any other value, so a frame can be neither replayed nor reordered.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::stream::Stream;
use crate::util::{deadline_after, nonzero};

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 4] = *b"FRYX";
/// Protocol version spoken (and the only one accepted).
pub const VERSION: u8 = 2;
/// Hello bytes before the name: magic, version, auth, nonce, name length.
const HELLO_FIXED_LEN: usize = 4 + 1 + 1 + 16 + 1;
/// Largest hello (name of 255 bytes).
pub const HELLO_MAX_BYTES: usize = HELLO_FIXED_LEN + 255;
const MAC_LEN: usize = 32;
/// kind + seq + name_len + label_len.
const FIXED_LEN: usize = 1 + 8 + 1 + 1;
/// Domain of the hello proofs.
const PROOF_DOMAIN: &[u8] = b"ferry-p2p-v2 proof";
/// The first payload buffer; it doubles as bytes arrive, up to the frame's length.
pub const PAYLOAD_FIRST_CHUNK_BYTES: usize = 64 << 10;
/// Slowest sender accepted: a frame of `n` bytes must arrive within the I/O timeout
/// plus `n / MIN_RATE_BYTES_PER_S` seconds.
pub const MIN_RATE_BYTES_PER_S: u64 = 1 << 20;

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

/// Which end of the connection a side is; part of its hello proof, so a proof can
/// never be reflected back to the side that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that connected (the P2P client).
    Connecting = 1,
    /// The side that accepted (the listener).
    Accepting = 2,
}

impl Role {
    fn other(self) -> Role {
        match self {
            Role::Connecting => Role::Accepting,
            Role::Accepting => Role::Connecting,
        }
    }
}

/// A received frame.
#[derive(Debug)]
pub struct Frame {
    /// What it is.
    pub kind: Kind,
    /// The sender's agent name (always the name of the connection's hello).
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
    /// sequence, naming another agent); the connection cannot go on.
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

/// A byte source the frame reader can put a read timeout on (a socket; in tests and
/// fuzzing, a byte slice).
pub trait Source: Read {
    /// Bound the next reads by `timeout` (never zero).
    fn set_timeout(&self, timeout: Duration) -> io::Result<()>;
}

impl Source for TcpStream {
    fn set_timeout(&self, timeout: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

impl Source for Stream {
    fn set_timeout(&self, timeout: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

impl Source for &[u8] {
    fn set_timeout(&self, _timeout: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// A parsed hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Whether the sender authenticates (has a shared secret).
    pub auth: bool,
    /// The sender's fresh nonce.
    pub nonce: [u8; 16],
    /// The agent name the sender claims.
    pub name: String,
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_FIXED_LEN + self.name.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(u8::from(self.auth));
        out.extend_from_slice(&self.nonce);
        out.push(self.name.len().min(255) as u8);
        out.extend_from_slice(&self.name.as_bytes()[..self.name.len().min(255)]);
        out
    }

    /// The length of the name that a hello starting with `fixed` announces, after
    /// checking the fixed part (magic, version, auth mode).
    fn check_fixed(fixed: &[u8; HELLO_FIXED_LEN]) -> Result<usize, String> {
        if fixed[..4] != MAGIC {
            return Err("not a Ferry P2P hello".into());
        }
        if fixed[4] != VERSION {
            return Err(format!(
                "protocol version {} (this side speaks {VERSION})",
                fixed[4]
            ));
        }
        if fixed[5] > 1 {
            return Err(format!("auth mode {}", fixed[5]));
        }
        Ok(usize::from(fixed[HELLO_FIXED_LEN - 1]))
    }

    /// Parse a hello at the start of `bytes`; returns it and its length. The name must
    /// be a valid agent name.
    pub fn decode(bytes: &[u8]) -> Result<(Hello, usize), String> {
        let fixed: &[u8; HELLO_FIXED_LEN] = bytes
            .first_chunk()
            .ok_or_else(|| format!("hello of {} bytes is too short", bytes.len()))?;
        let name_len = Hello::check_fixed(fixed)?;
        let end = HELLO_FIXED_LEN + name_len;
        let name = bytes
            .get(HELLO_FIXED_LEN..end)
            .ok_or("hello name runs past the input")?;
        let name = std::str::from_utf8(name).map_err(|_| "hello name is not UTF-8")?;
        crate::check_agent_name(name).map_err(|e| format!("hello: {e}"))?;
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&fixed[6..22]);
        Ok((
            Hello {
                auth: fixed[5] == 1,
                nonce,
                name: name.to_owned(),
            },
            end,
        ))
    }
}

/// The HMAC state of the hello proof of the side with `role`, `own` hello and the
/// `peer`'s hello.
fn proof_mac(secret: &[u8], role: Role, own: &Hello, peer: &Hello) -> io::Result<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    m.update(PROOF_DOMAIN);
    m.update(&[role as u8]);
    m.update(&own.nonce);
    m.update(&peer.nonce);
    for name in [&own.name, &peer.name] {
        m.update(&[name.len() as u8]);
        m.update(name.as_bytes());
    }
    Ok(m)
}

/// The hello proof of the side with `role`, `own` hello and the `peer`'s hello.
pub fn hello_proof(
    secret: &[u8],
    role: Role,
    own: &Hello,
    peer: &Hello,
) -> io::Result<[u8; MAC_LEN]> {
    Ok(proof_mac(secret, role, own, peer)?
        .finalize()
        .into_bytes()
        .into())
}

/// One connection after the hello exchange: a [`FrameWriter`] and a [`FrameReader`] on
/// the same socket, usable together or split for two threads ([`Self::into_split`]).
pub struct FramedConn {
    writer: FrameWriter,
    reader: FrameReader,
}

/// Settings both halves of a connection share.
#[derive(Clone)]
pub struct FrameSettings {
    /// The shared secret, if frames are authenticated.
    pub secret: Option<Arc<[u8]>>,
    /// Largest frame body sent or accepted.
    pub max_frame_bytes: usize,
    /// Bound on each read and write inside a frame (and the base of a frame's deadline).
    pub io_timeout: Duration,
}

/// The sending half of a connection.
pub struct FrameWriter<W: Write = Stream> {
    stream: W,
    secret: Option<Arc<[u8]>>,
    peer_nonce: [u8; 16],
    send_seq: u64,
    max_frame_bytes: usize,
    /// The frame being sent: its length prefix and header (and head tag), and the
    /// payload and tag too when the payload is short (then one `write` sends it all).
    write_buf: Vec<u8>,
    /// Whether `write_buf` holds the payload (and tag) too.
    inline: bool,
    /// The tag of the frame being sent, when it is not inline.
    tag: Option<[u8; MAC_LEN]>,
}

/// The receiving half of a connection.
pub struct FrameReader<S: Source = Stream> {
    stream: S,
    secret: Option<Arc<[u8]>>,
    my_nonce: [u8; 16],
    /// The name the peer gave in its hello: every frame must carry it.
    peer_name: String,
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

/// Size of the read-ahead buffer; frame heads with their tag (at most 11 + 2 × 255 +
/// 32 bytes) always fit, payloads beyond it are read straight into their own buffer.
const READ_AHEAD_BYTES: usize = 16 << 10;
/// Payloads at least this long are written from the caller's buffer (with `writev`),
/// not copied.
const WRITE_COPY_MAX_BYTES: usize = 16 << 10;

fn io_refused(why: String) -> RecvError {
    RecvError::Refused(why)
}

/// Read exactly `buf.len()` bytes by `deadline` (the socket timeout is set to what is
/// left before each read).
fn read_exact_by(stream: &mut Stream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the hello did not arrive in time",
            ));
        }
        stream.set_read_timeout(Some(nonzero(left)))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl FramedConn {
    /// Exchange hellos (and, with a secret, proofs) on a fresh connection, as the side
    /// with `role` named `name`. Both sides must agree on authentication. The whole
    /// exchange must finish within `settings.io_timeout`.
    pub fn handshake(
        mut stream: Stream,
        role: Role,
        name: &str,
        settings: &FrameSettings,
    ) -> Result<FramedConn, RecvError> {
        let io_timeout = settings.io_timeout;
        let deadline = deadline_after(Instant::now(), io_timeout);
        let nonce = crate::util::nonce().map_err(|e| RecvError::Refused(e.to_string()))?;
        let own = Hello {
            auth: settings.secret.is_some(),
            nonce,
            name: name.to_owned(),
        };
        stream
            .set_write_timeout(Some(nonzero(io_timeout)))
            .map_err(RecvError::Io)?;
        stream.write_all(&own.encode()).map_err(RecvError::Io)?;
        let eof = |e: io::Error| match e.kind() {
            io::ErrorKind::UnexpectedEof => RecvError::Closed,
            _ => RecvError::Io(e),
        };
        let mut raw = [0u8; HELLO_MAX_BYTES];
        read_exact_by(&mut stream, &mut raw[..HELLO_FIXED_LEN], deadline).map_err(eof)?;
        let fixed: &[u8; HELLO_FIXED_LEN] = raw.first_chunk().ok_or(RecvError::Closed)?;
        let name_len = Hello::check_fixed(fixed).map_err(io_refused)?;
        let end = HELLO_FIXED_LEN + name_len;
        read_exact_by(&mut stream, &mut raw[HELLO_FIXED_LEN..end], deadline).map_err(eof)?;
        let (peer, _) = Hello::decode(&raw[..end]).map_err(io_refused)?;
        match (peer.auth, own.auth) {
            (false, true) => {
                return Err(RecvError::Refused(
                    "peer does not authenticate, this side requires a shared secret".into(),
                ))
            }
            (true, false) => {
                return Err(RecvError::Refused(
                    "peer requires authentication, this side has no shared secret".into(),
                ))
            }
            _ => {}
        }
        if peer.nonce == own.nonce {
            return Err(RecvError::Refused(
                "the peer's hello echoes this side's nonce (a reflection)".into(),
            ));
        }
        if let Some(secret) = &settings.secret {
            let proof = hello_proof(secret, role, &own, &peer).map_err(RecvError::Io)?;
            stream.write_all(&proof).map_err(RecvError::Io)?;
            let mut theirs = [0u8; MAC_LEN];
            read_exact_by(&mut stream, &mut theirs, deadline).map_err(eof)?;
            // Constant-time comparison inside `verify_slice`.
            proof_mac(secret, role.other(), &peer, &own)
                .map_err(RecvError::Io)?
                .verify_slice(&theirs)
                .map_err(|_| {
                    RecvError::Refused(format!(
                        "the hello proof of '{}' does not match (wrong shared secret?)",
                        peer.name.escape_debug()
                    ))
                })?;
        }
        let write_stream = stream.try_clone().map_err(RecvError::Io)?;
        let reader = FrameReader::new(stream, settings, nonce, peer.name);
        reader
            .stream
            .set_read_timeout(Some(nonzero(io_timeout)))
            .map_err(RecvError::Io)?;
        Ok(FramedConn {
            writer: FrameWriter::new(write_stream, settings, peer.nonce),
            reader,
        })
    }

    /// The socket (for its addresses and shutdown).
    pub fn stream(&self) -> &TcpStream {
        self.reader.stream.socket()
    }

    /// The agent name the peer gave in its hello (proven when a secret is set).
    pub fn peer_name(&self) -> &str {
        &self.reader.peer_name
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

impl<W: Write> FrameWriter<W> {
    /// A writer of frames to a peer whose hello carried `peer_nonce` (after the hello
    /// exchange; public for tests and fuzzing, which write frames into a `Vec`).
    pub fn new(stream: W, settings: &FrameSettings, peer_nonce: [u8; 16]) -> FrameWriter<W> {
        FrameWriter {
            stream,
            secret: settings.secret.clone(),
            peer_nonce,
            send_seq: 0,
            max_frame_bytes: settings.max_frame_bytes,
            write_buf: Vec::new(),
            inline: true,
            tag: None,
        }
    }

    /// The stream written to.
    pub fn stream(&self) -> &W {
        &self.stream
    }

    /// Send one frame. A frame over the size limit is refused before anything is sent.
    pub fn send(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
        self.start(kind, name, label, payload)?;
        self.finish(payload)
    }

    /// Encode a frame without sending it: the size checks (an `InvalidInput` error for
    /// a frame over the limit), the header and the tags. [`Self::finish`] sends it; a
    /// writer whose encoded frame is not sent must be abandoned (the frame used up its
    /// sequence number).
    pub fn start(&mut self, kind: Kind, name: &str, label: &str, payload: &[u8]) -> io::Result<()> {
        let mac_len = if self.secret.is_some() {
            2 * MAC_LEN
        } else {
            0
        };
        let body_len =
            (FIXED_LEN + name.len() + label.len() + mac_len).saturating_add(payload.len());
        if body_len > self.max_frame_bytes
            || body_len > u32::MAX as usize
            || name.len() > 255
            || label.len() > 255
        {
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
                let mut head = hmac_start(secret, &self.peer_nonce, b'H')?;
                head.update(buf);
                let head_tag = head.finalize().into_bytes();
                let mut m = hmac_start(secret, &self.peer_nonce, b'B')?;
                m.update(buf);
                m.update(payload);
                buf.extend_from_slice(&head_tag);
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

/// `write_all` over several buffers, with as few `writev` calls as the stream allows.
fn write_all_vectored(stream: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
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

impl<S: Source> FrameReader<S> {
    /// A reader of frames from the peer named `peer_name`, this side's hello having
    /// carried `my_nonce` (after the hello exchange; public for tests and fuzzing,
    /// which read from a byte slice).
    pub fn new(
        stream: S,
        settings: &FrameSettings,
        my_nonce: [u8; 16],
        peer_name: String,
    ) -> FrameReader<S> {
        FrameReader {
            stream,
            secret: settings.secret.clone(),
            my_nonce,
            peer_name,
            recv_seq: 0,
            max_frame_bytes: settings.max_frame_bytes,
            io_timeout: settings.io_timeout,
            read_timeout: nonzero(settings.io_timeout),
            read_buf: vec![0u8; READ_AHEAD_BYTES].into_boxed_slice(),
            read_pos: 0,
            read_end: 0,
        }
    }

    /// The stream read from (for shutdown).
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// The name the peer gave in its hello.
    pub fn peer_name(&self) -> &str {
        &self.peer_name
    }

    fn set_read_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        let timeout = nonzero(timeout);
        if timeout != self.read_timeout {
            self.stream.set_timeout(timeout)?;
            self.read_timeout = timeout;
        }
        Ok(())
    }

    /// Bound the next read by the I/O timeout and by what is left until `deadline`.
    fn before_read(&mut self, deadline: Instant) -> Result<(), RecvError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RecvError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "the frame did not arrive within its deadline",
            )));
        }
        self.set_read_timeout(left.min(self.io_timeout))
            .map_err(RecvError::Io)
    }

    /// Make at least `n` (<= READ_AHEAD_BYTES) unconsumed bytes available.
    fn fill(&mut self, n: usize, deadline: Instant) -> Result<(), RecvError> {
        if self.read_end - self.read_pos >= n {
            return Ok(());
        }
        if self.read_pos + n > self.read_buf.len() {
            self.read_buf.copy_within(self.read_pos..self.read_end, 0);
            self.read_end -= self.read_pos;
            self.read_pos = 0;
        }
        while self.read_end - self.read_pos < n {
            self.before_read(deadline)?;
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

    /// Fill `out` completely: first what was read ahead, then straight from the stream.
    fn take_into(&mut self, out: &mut [u8], deadline: Instant) -> Result<(), RecvError> {
        self.take_into_macced(out, deadline, None)
    }

    /// [`Self::take_into`], feeding `mac` each piece as soon as it arrived (while it is
    /// still in cache, and while the next piece is on its way).
    fn take_into_macced(
        &mut self,
        out: &mut [u8],
        deadline: Instant,
        mut mac: Option<&mut HmacSha256>,
    ) -> Result<(), RecvError> {
        let ahead = (self.read_end - self.read_pos).min(out.len());
        out[..ahead].copy_from_slice(&self.read_buf[self.read_pos..self.read_pos + ahead]);
        self.read_pos += ahead;
        if let Some(m) = mac.as_deref_mut() {
            m.update(&out[..ahead]);
        }
        let mut got = ahead;
        while got < out.len() {
            self.before_read(deadline)?;
            match self.stream.read(&mut out[got..]) {
                Ok(0) => {
                    return Err(RecvError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed inside a frame",
                    )))
                }
                Ok(n) => {
                    if let Some(m) = mac.as_deref_mut() {
                        m.update(&out[got..got + n]);
                    }
                    got += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RecvError::Io(e)),
            }
        }
        Ok(())
    }

    /// Read a payload of `len` bytes into a buffer that grows with what arrived:
    /// [`PAYLOAD_FIRST_CHUNK_BYTES`] first, then doubling, so its capacity is never
    /// more than about twice the bytes received (nothing is reserved at the announced
    /// length). `mac` (the frame's tag, when authenticated) is fed as bytes arrive.
    fn read_payload(
        &mut self,
        len: usize,
        deadline: Instant,
        mut mac: Option<&mut HmacSha256>,
    ) -> Result<Vec<u8>, RecvError> {
        let mut payload = Vec::new();
        while payload.len() < len {
            let have = payload.len();
            let target = len.min(have.saturating_mul(2).max(PAYLOAD_FIRST_CHUNK_BYTES));
            payload.reserve_exact(target - have);
            payload.resize(target, 0);
            self.take_into_macced(&mut payload[have..target], deadline, mac.as_deref_mut())?;
        }
        Ok(payload)
    }

    /// Receive one frame, waiting at most `first_byte_timeout` for it to start (then
    /// the frame's deadline for the rest: module docs). [`RecvError::Idle`] when none
    /// started: the connection is still usable.
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
        let started = Instant::now();
        // The head must arrive within the I/O timeout; the deadline grows with the
        // announced length only once the head is known (and authenticated).
        let head_deadline = deadline_after(started, self.io_timeout);
        self.fill(4, head_deadline)?;
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
        if body_len < FIXED_LEN + 2 * mac_len {
            return Err(RecvError::Refused(format!(
                "frame of {body_len} bytes is too short"
            )));
        }
        // The signed part: everything but the final tag. The head and its tag lie
        // within the read-ahead buffer; they are read field by field, so nothing past
        // them is waited for before the head tag is checked.
        let signed_len = body_len - mac_len;
        let within = |n: usize| {
            if n > signed_len {
                Err(RecvError::Refused("frame head runs past the frame".into()))
            } else {
                Ok(4 + n)
            }
        };
        // (`fill` may move the unconsumed bytes: positions are taken after each.)
        self.fill(within(FIXED_LEN - 1)?, head_deadline)?;
        let name_len = usize::from(self.read_buf[self.read_pos + 4 + FIXED_LEN - 2]);
        self.fill(within(FIXED_LEN + name_len)?, head_deadline)?;
        let label_len = usize::from(self.read_buf[self.read_pos + 4 + FIXED_LEN - 1 + name_len]);
        let head_len = FIXED_LEN + name_len + label_len;
        self.fill(within(head_len + mac_len)?, head_deadline)?;
        let start = self.read_pos + 4;
        let raw = parse(&self.read_buf[start..start + head_len])?;
        let head_end = start + head_len;
        let mut body_mac = match &self.secret {
            Some(secret) => {
                let head = &self.read_buf[self.read_pos..head_end];
                let mut m = hmac_start(secret, &self.my_nonce, b'H').map_err(RecvError::Io)?;
                m.update(head);
                // Constant-time comparison inside `verify_slice`.
                m.verify_slice(&self.read_buf[head_end..head_end + MAC_LEN])
                    .map_err(|_| {
                        RecvError::Refused(
                            "authentication tag of the frame head does not match".into(),
                        )
                    })?;
                let mut body = hmac_start(secret, &self.my_nonce, b'B').map_err(RecvError::Io)?;
                body.update(head);
                Some(body)
            }
            None => None,
        };
        // From here the head is authentic (with a secret) or at least well-formed.
        if raw.seq != self.recv_seq {
            return Err(RecvError::Refused(format!(
                "sequence number {} where {} was due",
                raw.seq, self.recv_seq
            )));
        }
        if raw.name != self.peer_name {
            return Err(RecvError::Refused(format!(
                "frame names agent '{}', the connection's hello named '{}'",
                raw.name.escape_debug(),
                self.peer_name.escape_debug()
            )));
        }
        let (kind, name, label) = (raw.kind, raw.name.to_owned(), raw.label.to_owned());
        self.read_pos = head_end + mac_len;
        let payload_len = signed_len - head_len - mac_len;
        let deadline = deadline_after(
            head_deadline,
            Duration::from_secs(body_len as u64 / MIN_RATE_BYTES_PER_S),
        );
        let payload = self.read_payload(payload_len, deadline, body_mac.as_mut())?;
        if let Some(m) = body_mac.take() {
            let mut tag = [0u8; MAC_LEN];
            self.take_into(&mut tag, deadline)?;
            m.verify_slice(&tag)
                .map_err(|_| RecvError::Refused("authentication tag does not match".into()))?;
        }
        self.recv_seq += 1;
        Ok(Frame {
            kind,
            name,
            label,
            payload,
        })
    }
}

/// The head at the start of a body, borrowing it.
#[derive(Debug, PartialEq)]
struct RawHeader<'a> {
    kind: Kind,
    name: &'a str,
    label: &'a str,
    seq: u64,
    /// Bytes of the body before the payload (and head tag).
    len: usize,
}

/// Parse the head at the start of `body`.
fn parse(body: &[u8]) -> Result<RawHeader<'_>, RecvError> {
    parse_head(body).map_err(RecvError::Refused)
}

fn parse_head(body: &[u8]) -> Result<RawHeader<'_>, String> {
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

fn hmac_start(secret: &[u8], nonce: &[u8; 16], domain: u8) -> io::Result<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(secret)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    m.update(nonce);
    m.update(&[domain]);
    Ok(m)
}

/// The shared harness of the P2P frame fuzz target (`metadata/fuzz`) and the stable
/// property test: parses `data` as a hello and as a stream of frames, and checks the
/// properties that must hold for any input. Panics when one does not hold.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// The frame limit used by [`exercise`].
    pub const MAX_FRAME_BYTES: usize = 1 << 20;
    /// The name of the peer the exercised reader expects in frames.
    const PEER: &str = "peer";

    fn settings(secret: bool) -> FrameSettings {
        FrameSettings {
            secret: secret.then(|| Arc::from(&b"fuzz secret"[..])),
            max_frame_bytes: MAX_FRAME_BYTES,
            io_timeout: Duration::from_secs(1),
        }
    }

    fn reader(bytes: &[u8], secret: bool) -> FrameReader<&[u8]> {
        FrameReader::new(bytes, &settings(secret), [9; 16], PEER.into())
    }

    /// Read frames until an error; every frame respects the limits and names the peer.
    fn read_all(bytes: &[u8], secret: bool) -> Vec<Frame> {
        let mut r = reader(bytes, secret);
        let mut frames = Vec::new();
        while let Ok(f) = r.recv(Duration::from_millis(1)) {
            assert!(f.payload.len() <= MAX_FRAME_BYTES);
            assert_eq!(f.name, PEER);
            frames.push(f);
        }
        frames
    }

    /// Run every property on `data`: the first byte chooses a mode (bit 0: with a
    /// secret; bit 1: frames built from the rest and written by the real writer, with
    /// one byte flipped where the input says, instead of raw bytes).
    pub fn exercise(data: &[u8]) {
        let Some((&mode, rest)) = data.split_first() else {
            return;
        };
        if let Ok((hello, len)) = Hello::decode(rest) {
            assert!(len <= HELLO_MAX_BYTES && len <= rest.len());
            assert_eq!(
                hello.encode(),
                &rest[..len],
                "a hello re-encodes to its bytes"
            );
        }
        let secret = mode & 1 == 1;
        if mode & 2 == 0 {
            read_all(rest, secret);
            return;
        }
        // Structured: [flip position u32][flip xor u8] then frames, each
        // [kind][label_len][label][payload_len u16][payload], cut where the input ends.
        let Some((head, mut spec)) = rest.split_first_chunk::<5>() else {
            return;
        };
        let flip_at = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let flip_xor = head[4];
        let mut w = FrameWriter::new(Vec::new(), &settings(secret), [9; 16]);
        let mut written: Vec<(Kind, String, Vec<u8>, usize)> = Vec::new();
        while let Some((&kind, tail)) = spec.split_first() {
            let kind = Kind::from_u8(kind % 5 + 1).unwrap_or(Kind::Load);
            let Some((&label_len, tail)) = tail.split_first() else {
                break;
            };
            let label_len = usize::from(label_len % 32).min(tail.len());
            let label = String::from_utf8_lossy(&tail[..label_len]).into_owned();
            let tail = &tail[label_len..];
            let Some((len, tail)) = tail.split_first_chunk::<2>() else {
                break;
            };
            let payload_len = usize::from(u16::from_le_bytes(*len)).min(tail.len());
            let payload = tail[..payload_len].to_vec();
            spec = &tail[payload_len..];
            if w.send(kind, PEER, &label, &payload).is_err() {
                break; // a label over 255 bytes after lossy decoding
            }
            written.push((kind, label, payload, w.stream().len()));
        }
        let mut bytes = w.stream;
        let flipped = flip_xor != 0 && flip_at < bytes.len();
        if flipped {
            bytes[flip_at] ^= flip_xor;
        }
        let read = read_all(&bytes, secret);
        // Frames that end before the flipped byte come back intact; with a secret
        // nothing from the flipped byte on is accepted, without a flip everything is.
        let intact = if flipped {
            written.iter().filter(|w| w.3 <= flip_at).count()
        } else {
            written.len()
        };
        assert!(
            read.len() >= intact,
            "{} of {intact} intact frames read",
            read.len()
        );
        if secret || !flipped {
            assert_eq!(
                read.len(),
                intact,
                "a corrupted authenticated frame was accepted"
            );
        }
        for (f, (kind, label, payload, _)) in read.iter().zip(&written).take(intact) {
            assert_eq!((f.kind, &f.label, &f.payload), (*kind, label, payload));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn settings(secret: Option<&[u8]>) -> FrameSettings {
        FrameSettings {
            secret: secret.map(Arc::from),
            max_frame_bytes: 1 << 20,
            io_timeout: Duration::from_secs(2),
        }
    }

    fn pair(
        a: Option<&[u8]>,
        b: Option<&[u8]>,
    ) -> (Result<FramedConn, RecvError>, Result<FramedConn, RecvError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let b = settings(b);
        let t = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            FramedConn::handshake(
                crate::stream::Stream::Plain(s),
                Role::Accepting,
                "agent-b",
                &b,
            )
        });
        let s = TcpStream::connect(addr).unwrap();
        let a = FramedConn::handshake(
            crate::stream::Stream::Plain(s),
            Role::Connecting,
            "agent-a",
            &settings(a),
        );
        (a, t.join().unwrap())
    }

    #[test]
    fn frames_round_trip_with_and_without_auth() {
        for secret in [None, Some(&b"s3cret"[..])] {
            let (a, b) = pair(secret, secret);
            let (mut a, mut b) = (a.unwrap(), b.unwrap());
            assert_eq!((a.peer_name(), b.peer_name()), ("agent-b", "agent-a"));
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
    fn auth_mismatch_and_wrong_secret_are_refused_at_the_hello() {
        let (a, b) = pair(Some(b"x"), None);
        assert!(matches!(a, Err(RecvError::Refused(_))));
        assert!(matches!(b, Err(RecvError::Refused(_))));
        let (a, b) = pair(Some(b"x"), Some(b"y"));
        assert!(matches!(a, Err(RecvError::Refused(r)) if r.contains("proof")));
        assert!(matches!(b, Err(RecvError::Refused(r)) if r.contains("proof")));
    }

    #[test]
    fn a_frame_naming_another_agent_is_refused() {
        for secret in [None, Some(&b"s"[..])] {
            let (a, b) = pair(secret, secret);
            let (mut a, mut b) = (a.unwrap(), b.unwrap());
            a.send(Kind::Load, "agent-c", "metadata", b"x").unwrap();
            assert!(
                matches!(b.recv(Duration::from_secs(2)), Err(RecvError::Refused(r)) if r.contains("agent-c")),
            );
        }
    }

    #[test]
    fn proofs_are_bound_to_role_nonces_and_names() {
        let h = |nonce: u8, name: &str| Hello {
            auth: true,
            nonce: [nonce; 16],
            name: name.into(),
        };
        let (x, y) = (h(1, "x"), h(2, "y"));
        let p = hello_proof(b"k", Role::Connecting, &x, &y).unwrap();
        assert_ne!(p, hello_proof(b"k", Role::Accepting, &x, &y).unwrap());
        assert_ne!(p, hello_proof(b"k", Role::Connecting, &y, &x).unwrap());
        assert_ne!(
            p,
            hello_proof(b"k", Role::Connecting, &h(1, "z"), &y).unwrap()
        );
        assert_ne!(
            p,
            hello_proof(b"k", Role::Connecting, &x, &h(3, "y")).unwrap()
        );
        assert_ne!(p, hello_proof(b"j", Role::Connecting, &x, &y).unwrap());
        // Name-length framing: ("ab", "c") and ("a", "bc") differ.
        assert_ne!(
            hello_proof(b"k", Role::Connecting, &h(1, "ab"), &h(2, "c")).unwrap(),
            hello_proof(b"k", Role::Connecting, &h(1, "a"), &h(2, "bc")).unwrap()
        );
    }

    #[test]
    fn oversized_frames_are_refused_on_both_sides() {
        let (a, b) = pair(None, None);
        let (mut a, mut b) = (a.unwrap(), b.unwrap());
        assert!(a
            .send(Kind::Load, "agent-a", "metadata", &vec![0; 2 << 20])
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

    /// Frames written into a `Vec` by a writer with `secret`, for a reader whose nonce
    /// is `[9; 16]`.
    fn encoded(secret: Option<&[u8]>, frames: &[(Kind, &str, &str, &[u8])]) -> Vec<u8> {
        let mut w = FrameWriter::new(Vec::new(), &settings(secret), [9; 16]);
        for (kind, name, label, payload) in frames {
            w.send(*kind, name, label, payload).unwrap();
        }
        w.stream
    }

    fn reader<'a>(bytes: &'a [u8], secret: Option<&[u8]>) -> FrameReader<&'a [u8]> {
        FrameReader::new(bytes, &settings(secret), [9; 16], "p".into())
    }

    #[test]
    fn a_forged_head_is_refused_before_its_payload_is_read() {
        let big = vec![7u8; 200_000];
        let mut bytes = encoded(Some(b"k"), &[(Kind::Load, "p", "metadata", &big)]);
        // Flip a bit of the head tag: refused from the head alone. Cut the payload
        // off entirely: the refusal still names the head tag (nothing of it was read).
        let head_len = 4 + FIXED_LEN + 1 + 8;
        bytes[head_len] ^= 1;
        bytes.truncate(head_len + MAC_LEN);
        let mut r = reader(&bytes, Some(b"k"));
        assert!(
            matches!(r.recv(Duration::from_secs(1)), Err(RecvError::Refused(w)) if w.contains("head")),
        );
    }

    #[test]
    fn payload_buffers_grow_with_the_bytes_received() {
        // A frame that announces 1 MiB and sends 10 bytes: the reader allocated at
        // most its first chunk before the input ended.
        let mut bytes = encoded(None, &[(Kind::Load, "p", "l", &[1; 1000])]);
        let announced = (1u32 << 20) - 16;
        bytes[..4].copy_from_slice(&announced.to_le_bytes());
        bytes.truncate(40);
        let mut r = reader(&bytes, None);
        assert!(matches!(
            r.recv(Duration::from_secs(1)),
            Err(RecvError::Io(_))
        ));
        let frames = encoded(None, &[(Kind::Load, "p", "l", &vec![3; 700_000])]);
        let f = reader(&frames, None).recv(Duration::from_secs(1)).unwrap();
        assert_eq!(f.payload.len(), 700_000);
        assert!(
            f.payload.capacity() <= 2 * 700_000,
            "{}",
            f.payload.capacity()
        );
    }

    #[test]
    fn hello_decoding_checks_every_field() {
        let hello = Hello {
            auth: true,
            nonce: [4; 16],
            name: "prefill-0".into(),
        };
        let bytes = hello.encode();
        assert_eq!(Hello::decode(&bytes).unwrap(), (hello, bytes.len()));
        assert!(Hello::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut bad = bytes.clone();
        bad[4] = 1;
        assert!(Hello::decode(&bad).unwrap_err().contains("version"));
        let mut bad = bytes.clone();
        bad[5] = 2;
        assert!(Hello::decode(&bad).is_err());
        let mut bad = bytes.clone();
        bad[23] = b'/';
        assert!(Hello::decode(&bad).is_err(), "not an agent name");
        let mut bad = bytes;
        bad[22] = 0;
        assert!(Hello::decode(&bad).is_err(), "empty name");
    }

    #[test]
    fn parse_rejects_truncated_fields() {
        assert!(parse_head(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 5, b'a']).is_err());
        assert!(parse_head(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        let h = parse_head(&[2, 7, 0, 0, 0, 0, 0, 0, 0, 1, b'a', 0, 9, 9]).unwrap();
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
