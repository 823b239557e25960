//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! The length is checked against the limit before any buffer grows, so a hostile or corrupt
//! prefix costs nothing. One buffer per connection is reused for every frame in both
//! directions. After any error the stream position is unknown: drop the connection.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::WireError;

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
        self.buffer.clear();
        self.buffer.extend_from_slice(&[0; HEADER_LEN]);
        fill(&mut self.buffer)?;
        let body_len = self.buffer.len() - HEADER_LEN;
        let header = u32::try_from(body_len)
            .ok()
            .filter(|_| body_len <= self.max_frame)
            .ok_or(WireError::FrameTooLarge {
                len: body_len as u64,
                max: self.max_frame as u64,
            })?;
        self.buffer[..HEADER_LEN].copy_from_slice(&header.to_be_bytes());
        let write = async {
            self.stream.write_all(&self.buffer).await?;
            self.stream.flush().await
        };
        tokio::time::timeout(self.write_timeout, write)
            .await
            .map_err(|_| WireError::Timeout {
                op: "sending a frame",
                after: self.write_timeout,
            })?
            .map_err(|source| WireError::Io {
                op: "sending a frame",
                source,
            })
    }

    /// Receives one frame body. `wait_for_start` bounds the wait for the frame's first byte
    /// (an idle server connection waits longer than a client awaiting its reply); the rest of
    /// the frame must arrive within the read timeout.
    pub async fn recv(&mut self, wait_for_start: Duration) -> Result<&[u8], WireError> {
        let mut header = [0u8; HEADER_LEN];
        let first = tokio::time::timeout(wait_for_start, self.stream.read(&mut header))
            .await
            .map_err(|_| WireError::Timeout {
                op: "waiting for a frame",
                after: wait_for_start,
            })?
            .map_err(|source| WireError::Io {
                op: "receiving a frame",
                source,
            })?;
        if first == 0 {
            return Err(WireError::Closed);
        }
        let read_timeout = self.read_timeout;
        let timed_out = || WireError::Timeout {
            op: "receiving a frame",
            after: read_timeout,
        };
        tokio::time::timeout(read_timeout, self.stream.read_exact(&mut header[first..]))
            .await
            .map_err(|_| timed_out())?
            .map_err(|source| truncated_or_io(source, HEADER_LEN))?;
        let len = u32::from_be_bytes(header) as usize;
        if len > self.max_frame {
            return Err(WireError::FrameTooLarge {
                len: len as u64,
                max: self.max_frame as u64,
            });
        }
        self.buffer.clear();
        // `resize` alone may double the capacity, overshooting the limit by up to 2x.
        self.buffer.reserve_exact(len);
        self.buffer.resize(len, 0);
        tokio::time::timeout(read_timeout, self.stream.read_exact(&mut self.buffer))
            .await
            .map_err(|_| timed_out())?
            .map_err(|source| truncated_or_io(source, len))?;
        Ok(&self.buffer)
    }
}

impl FramedStream<tokio::net::TcpStream> {
    /// True when the peer has closed (or reset) a connection we are not reading from, e.g. a
    /// server that dropped an idle client. Checked without blocking before reusing a
    /// connection, so a request is never written into a socket the peer already abandoned.
    pub fn peer_has_closed(&self) -> bool {
        let mut probe = [0u8; 1];
        match self.stream.try_read(&mut probe) {
            Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
            // Bytes nobody asked for mean the stream is out of step: treat it as closed too.
            Ok(_) => true,
        }
    }
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
