//! Reading a body out of a connection's buffer, by its framing: `Content-Length`,
//! chunked transfer coding, or until the connection closes.

use bytes::{Buf, Bytes, BytesMut};

/// Longest chunk-size line (with its extensions) or trailer line accepted.
const MAX_LINE: usize = 4096;

/// Most bytes of trailer lines accepted after the last chunk.
const MAX_TRAILERS: usize = 16 * 1024;

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
    /// After the last chunk, reading trailer lines up to the empty one; this many trailer
    /// bytes were read so far.
    Trailers(usize),
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

/// The body is not framed as it says: a chunked body that breaks RFC 9112 §7.1 (a chunk
/// size that is not 1*HEXDIG or over 64 bits, an extension that is not
/// `;name[=token|"quoted"]`, chunk data not followed by CRLF, a trailer that is not a
/// field line, a bare CR or LF anywhere, a line or the trailers over their limits), or a
/// body cut short by the end of the connection.
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

    /// Body bytes announced and not yet taken: what is left of the `Content-Length`, or
    /// of the chunk being read (0 between chunks and for close-delimited bodies). A reader
    /// with a size limit can refuse a body as soon as it is announced.
    #[inline]
    pub fn announced(&self) -> u64 {
        match self {
            Framing::Length(remaining) | Framing::Chunked(ChunkState::Data(remaining)) => {
                *remaining
            }
            Framing::Chunked(_) | Framing::Close => 0,
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
                let Some((size, line)) = size_line(buf)? else {
                    break false;
                };
                buf.advance(line);
                *state = if size == 0 {
                    ChunkState::Trailers(0)
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
                if !b"\r\n".starts_with(&buf[..buf.len().min(2)]) {
                    return Err(BadFraming);
                }
                if buf.len() < 2 {
                    break false;
                }
                buf.advance(2);
                *state = ChunkState::Size;
            }
            ChunkState::Trailers(read) => {
                let Some(line) = trailer_line(buf)? else {
                    break false;
                };
                buf.advance(line);
                if line == 2 {
                    *state = ChunkState::Done;
                    break true;
                }
                if read + line > MAX_TRAILERS {
                    return Err(BadFraming);
                }
                *state = ChunkState::Trailers(read + line);
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

/// Where a chunk-size line is (RFC 9112 §7.1.1:
/// `1*HEXDIG *( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] ) CRLF`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SizeAt {
    /// In the size's digits.
    Digits,
    /// After blanks that must lead to `;`.
    Blank,
    /// After `;` (and blanks), before an extension's name.
    NameStart,
    /// In an extension's name.
    Name,
    /// After blanks following a name: `=` or `;` must come.
    NameBlank,
    /// After `=` (and blanks), before the value.
    ValueStart,
    /// In a token value.
    Token,
    /// In a quoted-string value.
    Quoted,
    /// After a backslash in a quoted-string.
    Escaped,
    /// After a quoted-string's closing quote.
    QuotedEnd,
    /// After CR: LF must come.
    Cr,
}

/// The size of the chunk-size line at the start of `buf` and the line's length with its
/// CRLF, once all of it is there (`None`: more must come). An error as soon as the bytes
/// there cannot start a valid line.
fn size_line(buf: &[u8]) -> Result<Option<(u64, usize)>, BadFraming> {
    let mut size: u64 = 0;
    let mut at = SizeAt::Digits;
    for (position, &byte) in buf.iter().enumerate() {
        if position >= MAX_LINE {
            return Err(BadFraming);
        }
        let blank = matches!(byte, b' ' | b'\t');
        at = match at {
            SizeAt::Cr if byte == b'\n' => return Ok(Some((size, position + 1))),
            SizeAt::Digits if byte.is_ascii_hexdigit() => {
                let digit = u64::from((byte as char).to_digit(16).ok_or(BadFraming)?);
                size = size
                    .checked_mul(16)
                    .and_then(|size| size.checked_add(digit))
                    .ok_or(BadFraming)?;
                SizeAt::Digits
            }
            // At least one digit: the first byte is a digit or the line is refused.
            _ if position == 0 => return Err(BadFraming),
            SizeAt::Digits | SizeAt::Name | SizeAt::Token | SizeAt::QuotedEnd if byte == b'\r' => {
                SizeAt::Cr
            }
            SizeAt::Digits
            | SizeAt::Blank
            | SizeAt::Name
            | SizeAt::NameBlank
            | SizeAt::Token
            | SizeAt::QuotedEnd
                if byte == b';' =>
            {
                SizeAt::NameStart
            }
            SizeAt::Digits | SizeAt::Blank | SizeAt::Token | SizeAt::QuotedEnd if blank => {
                SizeAt::Blank
            }
            SizeAt::NameStart if blank => SizeAt::NameStart,
            SizeAt::NameStart | SizeAt::Name if is_tchar(byte) => SizeAt::Name,
            SizeAt::Name | SizeAt::NameBlank if blank => SizeAt::NameBlank,
            SizeAt::Name | SizeAt::NameBlank if byte == b'=' => SizeAt::ValueStart,
            SizeAt::ValueStart if blank => SizeAt::ValueStart,
            SizeAt::ValueStart if byte == b'"' => SizeAt::Quoted,
            SizeAt::ValueStart | SizeAt::Token if is_tchar(byte) => SizeAt::Token,
            SizeAt::Quoted if byte == b'"' => SizeAt::QuotedEnd,
            SizeAt::Quoted if byte == b'\\' => SizeAt::Escaped,
            // qdtext, and what a backslash may quote: HTAB, SP, VCHAR, obs-text.
            SizeAt::Quoted | SizeAt::Escaped if blank || (byte > 0x20 && byte != 0x7f) => {
                SizeAt::Quoted
            }
            _ => return Err(BadFraming),
        };
    }
    Ok(None)
}

/// The length (with its CRLF) of the trailer line at the start of `buf`, once all of it is
/// there (`None`: more must come); 2 for the empty line that ends the trailers. A trailer is
/// a field line (RFC 9112 §7.1.2: `token ":" OWS field-value OWS`, no control characters
/// but HTAB). An error as soon as the bytes there cannot start a valid line.
fn trailer_line(buf: &[u8]) -> Result<Option<usize>, BadFraming> {
    #[derive(Clone, Copy)]
    enum At {
        Start,
        Name,
        Value,
        Cr,
    }
    let mut at = At::Start;
    for (position, &byte) in buf.iter().enumerate() {
        if position >= MAX_LINE {
            return Err(BadFraming);
        }
        at = match at {
            At::Cr if byte == b'\n' => return Ok(Some(position + 1)),
            At::Start | At::Value if byte == b'\r' => At::Cr,
            At::Start | At::Name if is_tchar(byte) => At::Name,
            At::Name if byte == b':' => At::Value,
            At::Value if byte == b'\t' || (byte >= 0x20 && byte != 0x7f) => At::Value,
            _ => return Err(BadFraming),
        };
    }
    Ok(None)
}

/// Whether `byte` may appear in a token (RFC 9110 §5.6.2).
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
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

    /// Decodes `input` as a whole chunked body: its data, or the error.
    fn chunked(input: &[u8]) -> Result<(Vec<u8>, bool), BadFraming> {
        let mut framing = Framing::Chunked(ChunkState::Size);
        let mut buf = BytesMut::from(input);
        let mut body = Vec::new();
        loop {
            match framing.decode(&mut buf, false)? {
                Decoded::Data(data) => body.extend_from_slice(&data),
                Decoded::NeedMore => return Ok((body, false)),
                Decoded::End => return Ok((body, true)),
            }
        }
    }

    #[test]
    fn chunk_lines_follow_the_grammar() {
        for good in [
            &b"5\r\nhello\r\n0\r\n\r\n"[..],
            b"0005\r\nhello\r\n0\r\n\r\n",
            b"5;a\r\nhello\r\n0\r\n\r\n",
            b"5 ; a = b ;c=\"q \\\" ;\"\r\nhello\r\n0;z\r\n\r\n",
            b"5;a=b\r\nhello\r\n0\r\nx-t: v, w\r\ny:\r\n\r\n",
        ] {
            assert_eq!(
                chunked(good),
                Ok((b"hello".to_vec(), true)),
                "{:?}",
                String::from_utf8_lossy(good)
            );
        }
        for bad in [
            &b"\r\nhello\r\n0\r\n\r\n"[..],
            b";a\r\n",
            b"+5\r\nhello\r\n",
            b"-5\r\nhello\r\n",
            b"0x5\r\nhello\r\n",
            b" 5\r\nhello\r\n",
            b"5 \r\nhello\r\n",
            b"5\nhello\r\n",
            b"5\rhello\r\n",
            b"5;\r\nhello\r\n",
            b"5;a b\r\n",
            b"5;a=\r\n",
            b"5;a=\x00\r\n",
            b"5;a\x00\r\n",
            b"5;a=\"b\r\n",
            b"5;a=\"b\x01\"\r\n",
            b"5;a\nb\r\n",
            b"5\r\nhelloXY0\r\n\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"5\r\nhello\r\n0\r\n folded\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t v\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t: \x00\r\n\r\n",
            b"5\r\nhello\r\n0\r\n\n",
            b"10000000000000000\r\n",
            b"fffffffffffffffff\r\n",
        ] {
            assert_eq!(
                chunked(bad).map(|_| ()),
                Err(BadFraming),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn bad_bytes_are_refused_before_the_line_ends() {
        for partial in [
            &b"z"[..],
            b"5;\x00",
            b"5 x",
            b"5\r\nhelloX",
            b"5\r\nhello\r\n0\r\n\x01",
        ] {
            assert_eq!(chunked(partial).map(|_| ()), Err(BadFraming), "{partial:?}");
        }
        for partial in [
            &b"5"[..],
            b"5;a=\"x",
            b"5\r",
            b"5\r\nhello\r",
            b"0\r\nx-t: v",
        ] {
            assert!(
                matches!(chunked(partial), Ok((_, false))),
                "{partial:?} may still become valid"
            );
        }
        let long = format!("5;{}", "a".repeat(MAX_LINE));
        assert_eq!(chunked(long.as_bytes()).map(|_| ()), Err(BadFraming));
        let mut trailers = b"0\r\n".to_vec();
        for i in 0..2000 {
            trailers.extend_from_slice(format!("x-{i}: vvvv\r\n").as_bytes());
        }
        assert_eq!(chunked(&trailers).map(|_| ()), Err(BadFraming));
    }

    #[test]
    fn announced_bytes_are_known_before_they_arrive() {
        let mut framing = Framing::Chunked(ChunkState::Size);
        let mut buf = BytesMut::from(&b"fffffffffff\r\nab"[..]);
        assert_eq!(
            framing.decode(&mut buf, false),
            Ok(Decoded::Data(Bytes::from_static(b"ab")))
        );
        assert_eq!(framing.announced(), 0xfff_ffff_ffff - 2);
        assert_eq!(Framing::Length(7).announced(), 7);
        assert_eq!(Framing::Chunked(ChunkState::Size).announced(), 0);
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
