//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! The length is checked against the limit before any buffer grows, so a hostile or corrupt
//! prefix costs nothing. One buffer per connection is reused for every frame in both
//! directions. After any error the stream position is unknown: drop the connection.

use std::future::Future;
use std::os::fd::AsRawFd;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use super::rpc::FileRange;
use super::tls::Connection;
use super::{WireError, within};

const HEADER_LEN: usize = 4;

/// A framed byte stream (a TCP socket, or an in-memory pipe in tests).
#[derive(Debug)]
pub struct FramedStream<S> {
    stream: S,
    buffer: Vec<u8>,
    max_frame: usize,
    read_timeout: Duration,
    write_timeout: Duration,
}

impl<S: AsyncRead + AsyncWrite + Unpin> FramedStream<S> {
    pub fn new(
        stream: S,
        max_frame: usize,
        read_timeout: Duration,
        write_timeout: Duration,
    ) -> Self {
        Self {
            stream,
            buffer: Vec::new(),
            max_frame,
            read_timeout,
            write_timeout,
        }
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Changes the frame limit, e.g. from the small pre-authentication limit to the configured
    /// one once the peer has proved it knows the token.
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// Sends one frame whose body `fill` appends to the (cleared) buffer it is given.
    pub async fn send_with(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>) -> Result<(), WireError>,
    ) -> Result<(), WireError> {
        self.send_with_tail(fill, &[]).await
    }

    /// Sends one frame whose body is what `fill` appends to the (cleared) buffer, followed by
    /// `tail`, written from where it lies: a large payload is never copied into the buffer.
    pub async fn send_with_tail(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>) -> Result<(), WireError>,
        tail: &[u8],
    ) -> Result<(), WireError> {
        self.fill_head(fill, tail.len())?;
        let write = async {
            self.stream.write_all(&self.buffer).await?;
            if !tail.is_empty() {
                self.stream.write_all(tail).await?;
            }
            self.stream.flush().await
        };
        timed_write(self.write_timeout, write).await
    }

    /// Puts the length prefix and what `fill` appends in the buffer, for a frame whose body
    /// ends with `tail_len` more bytes.
    fn fill_head(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>) -> Result<(), WireError>,
        tail_len: usize,
    ) -> Result<(), WireError> {
        self.buffer.clear();
        self.buffer.extend_from_slice(&[0; HEADER_LEN]);
        fill(&mut self.buffer)?;
        let body_len = self.buffer.len() - HEADER_LEN + tail_len;
        let header = u32::try_from(body_len)
            .ok()
            .filter(|_| body_len <= self.max_frame)
            .ok_or(WireError::FrameTooLarge {
                len: body_len as u64,
                max: self.max_frame as u64,
            })?;
        self.buffer[..HEADER_LEN].copy_from_slice(&header.to_be_bytes());
        Ok(())
    }

    /// Receives one frame body. `wait_for_start` bounds the wait for the frame's first byte
    /// (an idle server connection waits longer than a client awaiting its reply); the rest of
    /// the frame must arrive within the read timeout.
    pub async fn recv(&mut self, wait_for_start: Duration) -> Result<&[u8], WireError> {
        let len = self.recv_len(wait_for_start).await?;
        self.recv_part(len).await
    }

    /// Reads the next frame's length, checked against the limit; the caller then reads exactly
    /// that many bytes with [`Self::recv_part`] and [`Self::recv_part_into`].
    pub async fn recv_len(&mut self, wait_for_start: Duration) -> Result<usize, WireError> {
        let mut header = [0u8; HEADER_LEN];
        let first = within(
            wait_for_start,
            "waiting for a frame",
            self.stream.read(&mut header),
        )
        .await?
        .map_err(|source| WireError::Io {
            op: "receiving a frame",
            source,
        })?;
        if first == 0 {
            return Err(WireError::Closed);
        }
        self.read_exact_timed(&mut header[first..])
            .await
            .map_err(|error| match error {
                WireError::Truncated { .. } => WireError::Truncated {
                    expected: HEADER_LEN,
                },
                other => other,
            })?;
        let len = u32::from_be_bytes(header) as usize;
        if len > self.max_frame {
            return Err(WireError::FrameTooLarge {
                len: len as u64,
                max: self.max_frame as u64,
            });
        }
        Ok(len)
    }

    /// Reads the next `len` bytes of the current frame into the connection's buffer.
    pub async fn recv_part(&mut self, len: usize) -> Result<&[u8], WireError> {
        let mut buffer = std::mem::take(&mut self.buffer);
        buffer.clear();
        // `resize` alone may double the capacity, overshooting the limit by up to 2x.
        buffer.reserve_exact(len);
        buffer.resize(len, 0);
        let read = self.read_exact_timed(&mut buffer).await;
        self.buffer = buffer;
        read.map(|()| self.buffer.as_slice())
    }

    /// Reads the next `dest.len()` bytes of the current frame straight into `dest`.
    pub async fn recv_part_into(&mut self, dest: &mut [u8]) -> Result<(), WireError> {
        self.read_exact_timed(dest).await
    }

    async fn read_exact_timed(&mut self, dest: &mut [u8]) -> Result<(), WireError> {
        let read_timeout = self.read_timeout;
        let expected = dest.len();
        within(
            read_timeout,
            "receiving a frame",
            self.stream.read_exact(dest),
        )
        .await?
        .map(|_| ())
        .map_err(|source| truncated_or_io(source, expected))
    }
}

impl FramedStream<Connection> {
    /// Like [`Self::send_with_tail`], with a tail of several `parts` sent one after the other.
    /// On a plain TCP connection a part that also lies in a file goes out with `sendfile(2)`,
    /// and the kernel may read the file's pages after this returns: the caller keeps them
    /// unchanged until the peer has read the frame. Inside TLS the bytes must be encrypted, so
    /// they are written from the part's bytes.
    pub async fn send_with_attachment(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>) -> Result<(), WireError>,
        parts: &[(&[u8], Option<&FileRange>)],
    ) -> Result<(), WireError> {
        let tail_len = parts
            .iter()
            .try_fold(0usize, |total, (bytes, _)| total.checked_add(bytes.len()))
            .ok_or(WireError::FrameTooLarge {
                len: u64::MAX,
                max: self.max_frame as u64,
            })?;
        self.fill_head(fill, tail_len)?;
        let write = async {
            self.stream.write_all(&self.buffer).await?;
            for (bytes, file) in parts {
                match (&mut self.stream, file) {
                    (Connection::Plain(socket), Some(range)) => {
                        send_file(socket, range, bytes.len()).await?;
                    }
                    (stream, _) => stream.write_all(bytes).await?,
                }
            }
            self.stream.flush().await
        };
        timed_write(self.write_timeout, write).await
    }

    /// True when the peer has closed (or reset) a connection we are not reading from, e.g. a
    /// server that dropped an idle client. Checked without blocking before reusing a
    /// connection, so a request is never written into a socket the peer already abandoned.
    pub fn peer_has_closed(&self) -> bool {
        self.stream.peer_has_closed()
    }
}

/// Sends `len` bytes of `range`'s file to `socket` with `sendfile(2)`, waiting whenever the
/// socket's buffer is full. Unlike `send`, `sendfile` cannot pass `MSG_NOSIGNAL`: a peer that
/// closed would raise SIGPIPE, which Rust programs ignore (floe resets it only for commands
/// that print listings, which serve nothing).
async fn send_file(socket: &TcpStream, range: &FileRange, len: usize) -> std::io::Result<()> {
    let mut offset = libc::off_t::try_from(range.offset)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut left = len;
    while left > 0 {
        socket.writable().await?;
        let sent = socket.try_io(Interest::WRITABLE, || {
            // SAFETY: both descriptors are open for the call (`socket` and `range.file` are
            // borrowed), and `offset` is a valid pointer to an `off_t` the call advances.
            let sent = unsafe {
                libc::sendfile(
                    socket.as_raw_fd(),
                    range.file.as_raw_fd(),
                    &mut offset,
                    left,
                )
            };
            usize::try_from(sent).map_err(|_| std::io::Error::last_os_error())
        });
        match sent {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the file ended before the attachment did",
                ));
            }
            Ok(sent) => left -= sent.min(left),
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

async fn timed_write(
    limit: Duration,
    write: impl Future<Output = std::io::Result<()>>,
) -> Result<(), WireError> {
    within(limit, "sending a frame", write)
        .await?
        .map_err(|source| WireError::Io {
            op: "sending a frame",
            source,
        })
}

fn truncated_or_io(source: std::io::Error, expected: usize) -> WireError {
    if source.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Truncated { expected }
    } else {
        WireError::Io {
            op: "receiving a frame",
            source,
        }
    }
}
