//! Reading a body out of a connection's buffer, by its framing: `Content-Length`,
//! chunked transfer coding, or until the connection closes.

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 4096;

/// How the body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes are still to come.
    Length(u64),
    /// Chunked, in the given state.
    Chunked(ChunkState),
    /// Everything until the peer closes the connection.
    Close,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkState {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk with this many data bytes to come.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, reading trailer lines up to the empty one.
    Trailers,
    /// The body is over.
    Done,
}

/// What the buffer held.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Body bytes.
    Data(Bytes),
    /// Nothing complete yet: read more.
    NeedMore,
    /// The body is over.
    End,
}

/// The body is not framed as it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadFraming;

impl Framing {
    /// Takes the body bytes at the start of `buf`: every complete piece there (chunked data
    /// of several chunks joined), or [`Decoded::End`] once the body is over. `eof`: the
    /// peer closed the connection.
    pub fn decode(&mut self, buf: &mut BytesMut, eof: bool) -> Result<Decoded, BadFraming> {
        match self {
            Framing::Length(0) => Ok(Decoded::End),
            Framing::Length(remaining) => {
                if buf.is_empty() {
                    return if eof {
                        Err(BadFraming)
                    } else {
                        Ok(Decoded::NeedMore)
                    };
                }
                let take =
                    usize::try_from(*remaining).map_or(buf.len(), |left| left.min(buf.len()));
                *remaining -= take as u64;
                Ok(Decoded::Data(buf.split_to(take).freeze()))
            }
            Framing::Close => {
                if !buf.is_empty() {
                    Ok(Decoded::Data(buf.split().freeze()))
                } else if eof {
                    Ok(Decoded::End)
                } else {
                    Ok(Decoded::NeedMore)
                }
            }
            Framing::Chunked(state) => {
                let decoded = decode_chunks(state, buf)?;
                if decoded == Decoded::NeedMore && eof {
                    return Err(BadFraming);
                }
                Ok(decoded)
            }
        }
    }

    /// Whether the body has been read to its end.
    pub fn is_done(&self) -> bool {
        matches!(
            self,
            Framing::Length(0) | Framing::Chunked(ChunkState::Done)
        )
    }
}

/// Decodes as many chunks as `buf` holds; their data is returned as one piece.
fn decode_chunks(state: &mut ChunkState, buf: &mut BytesMut) -> Result<Decoded, BadFraming> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut push = |data: Bytes| match (&mut joined, first.take()) {
        (Some(joined), _) => joined.extend_from_slice(&data),
        (None, None) => first = Some(data),
        (None, Some(previous)) => {
            let mut both = BytesMut::with_capacity(previous.len() + data.len());
            both.extend_from_slice(&previous);
            both.extend_from_slice(&data);
            joined = Some(both);
        }
    };
    let ended = loop {
        match *state {
            ChunkState::Size => {
                let Some(line) = line_length(buf)? else {
                    break false;
                };
                let size = chunk_size(&buf[..line])?;
                buf.advance(line + 2);
                *state = if size == 0 {
                    ChunkState::Trailers
                } else {
                    ChunkState::Data(size)
                };
            }
            ChunkState::Data(remaining) => {
                if buf.is_empty() {
                    break false;
                }
                let take = usize::try_from(remaining).map_or(buf.len(), |left| left.min(buf.len()));
                push(buf.split_to(take).freeze());
                let left = remaining - take as u64;
                *state = if left == 0 {
                    ChunkState::DataEnd
                } else {
                    ChunkState::Data(left)
                };
            }
            ChunkState::DataEnd => {
                if buf.len() < 2 {
                    break false;
                }
                if &buf[..2] != b"\r\n" {
                    return Err(BadFraming);
                }
                buf.advance(2);
                *state = ChunkState::Size;
            }
            ChunkState::Trailers => {
                let Some(line) = line_length(buf)? else {
                    break false;
                };
                buf.advance(line + 2);
                if line == 0 {
                    *state = ChunkState::Done;
                    break true;
                }
            }
            ChunkState::Done => break true,
        }
    };
    let data = joined.map(BytesMut::freeze).or(first);
    Ok(match (data, ended) {
        (Some(data), _) => Decoded::Data(data),
        (None, true) => Decoded::End,
        (None, false) => Decoded::NeedMore,
    })
}

/// The length of the CRLF-terminated line at the start of `buf` (without the CRLF), once
/// it is all there.
fn line_length(buf: &[u8]) -> Result<Option<usize>, BadFraming> {
    match buf.windows(2).position(|pair| pair == b"\r\n") {
        Some(end) => Ok(Some(end)),
        None if buf.len() > MAX_LINE => Err(BadFraming),
        None => Ok(None),
    }
}

/// The size of a chunk-size line (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Result<u64, BadFraming> {
    let digits = line
        .split(|&byte| byte == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(BadFraming);
    }
    digits.iter().try_fold(0u64, |size, &digit| {
        let value = (digit as char).to_digit(16).ok_or(BadFraming)?;
        Ok(size * 16 + u64::from(value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(framing: &mut Framing, input: &[u8]) -> (Vec<u8>, bool) {
        let mut buf = BytesMut::from(input);
        let mut body = Vec::new();
        loop {
            match framing.decode(&mut buf, false).unwrap() {
                Decoded::Data(data) => body.extend_from_slice(&data),
                Decoded::NeedMore => return (body, false),
                Decoded::End => return (body, true),
            }
        }
    }

    #[test]
    fn length_bodies_stop_at_their_length() {
        let mut framing = Framing::Length(5);
        let mut buf = BytesMut::from(&b"hel"[..]);
        assert_eq!(
            framing.decode(&mut buf, false),
            Ok(Decoded::Data(Bytes::from_static(b"hel")))
        );
        assert_eq!(framing.decode(&mut buf, false), Ok(Decoded::NeedMore));
        assert_eq!(framing.decode(&mut buf, true), Err(BadFraming));
        buf.extend_from_slice(b"loNEXT");
        assert_eq!(
            framing.decode(&mut buf, false),
            Ok(Decoded::Data(Bytes::from_static(b"lo")))
        );
        assert_eq!(framing.decode(&mut buf, false), Ok(Decoded::End));
        assert!(framing.is_done());
        assert_eq!(&buf[..], b"NEXT");
    }

    #[test]
    fn chunks_are_joined_and_the_end_is_found() {
        let mut framing = Framing::Chunked(ChunkState::Size);
        let input = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n";
        assert_eq!(
            decode_all(&mut framing, input),
            (b"hello world".to_vec(), true)
        );
    }

    #[test]
    fn bad_chunk_framing_is_an_error() {
        for input in [&b"zz\r\n"[..], b"3\r\nabcXY", b"12345678901234567\r\n"] {
            let mut framing = Framing::Chunked(ChunkState::Size);
            let mut buf = BytesMut::from(input);
            let mut result = Ok(Decoded::NeedMore);
            for _ in 0..4 {
                result = framing.decode(&mut buf, false);
                if !matches!(result, Ok(Decoded::Data(_))) {
                    break;
                }
            }
            assert_eq!(result, Err(BadFraming), "{input:?}");
        }
        let mut framing = Framing::Chunked(ChunkState::Size);
        let mut buf = BytesMut::from(&b"3\r\nab"[..]);
        let _ = framing.decode(&mut buf, false);
        assert_eq!(framing.decode(&mut buf, true), Err(BadFraming));
    }

    #[test]
    fn close_delimited_bodies_end_at_eof() {
        let mut framing = Framing::Close;
        let mut buf = BytesMut::from(&b"abc"[..]);
        assert_eq!(
            framing.decode(&mut buf, false),
            Ok(Decoded::Data(Bytes::from_static(b"abc")))
        );
        assert_eq!(framing.decode(&mut buf, false), Ok(Decoded::NeedMore));
        assert_eq!(framing.decode(&mut buf, true), Ok(Decoded::End));
    }
}
