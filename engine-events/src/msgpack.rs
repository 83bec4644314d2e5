//! A small zero-copy msgpack reader over a byte slice: just what the engines' KV event batches
//! need (integers, floats, strings, binaries, arrays, maps, skipping anything else), with
//! errors instead of panics on any input.

use rmp::Marker;

/// Nesting deeper than this is treated as malformed (no engine sends it; it bounds recursion).
const MAX_DEPTH: usize = 32;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub String);

pub(crate) type Result<T> = std::result::Result<T, DecodeError>;

pub(crate) fn malformed<T>(what: impl Into<String>) -> Result<T> {
    Err(DecodeError(what.into()))
}

/// The broad type of the next value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// A cursor over msgpack bytes.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The cursor position (for rewinding with [`Reader::seek`]).
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Moves the cursor back to a position returned by [`Reader::position`].
    pub(crate) fn seek(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.buf.get(self.pos..self.pos.saturating_add(n)) {
            Some(bytes) if self.pos.checked_add(n).is_some() => {
                self.pos += n;
                Ok(bytes)
            }
            _ => malformed("truncated message"),
        }
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn peek(&self) -> Result<Marker> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => malformed("truncated message"),
        }
    }

    fn marker(&mut self) -> Result<Marker> {
        let m = self.peek()?;
        self.pos += 1;
        Ok(m)
    }

    /// The kind of the next value, without consuming it.
    pub(crate) fn kind(&self) -> Result<Kind> {
        Ok(match self.peek()? {
            Marker::Null => Kind::Nil,
            Marker::True | Marker::False => Kind::Bool,
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64 => Kind::Int,
            Marker::F32 | Marker::F64 => Kind::Float,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => Kind::Ext,
            Marker::Reserved => return malformed("reserved msgpack marker"),
        })
    }

    /// Consumes a nil if one is next; tells whether it did.
    pub(crate) fn nil(&mut self) -> Result<bool> {
        if self.peek()? == Marker::Null {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// An integer of any width or sign; negative values are bit-cast (vLLM sends signed
    /// 64-bit hashes as well as unsigned ones).
    pub(crate) fn int(&mut self) -> Result<u64> {
        Ok(match self.marker()? {
            Marker::FixPos(v) => u64::from(v),
            Marker::FixNeg(v) => i64::from(v) as u64,
            Marker::U8 => u64::from(self.be::<1>()?[0]),
            Marker::U16 => u64::from(u16::from_be_bytes(self.be()?)),
            Marker::U32 => u64::from(u32::from_be_bytes(self.be()?)),
            Marker::U64 => u64::from_be_bytes(self.be()?),
            Marker::I8 => i64::from(self.be::<1>()?[0] as i8) as u64,
            Marker::I16 => i64::from(i16::from_be_bytes(self.be()?)) as u64,
            Marker::I32 => i64::from(i32::from_be_bytes(self.be()?)) as u64,
            Marker::I64 => i64::from_be_bytes(self.be()?) as u64,
            other => return malformed(format!("expected an integer, found {other:?}")),
        })
    }

    /// A non-negative integer that fits in `u32` (token ids, sizes).
    pub(crate) fn u32(&mut self) -> Result<u32> {
        let start = self.pos;
        let negative = matches!(
            self.peek()?,
            Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64
        );
        let v = self.int()?;
        if negative && (v as i64) < 0 {
            self.pos = start;
            return malformed("expected a non-negative integer");
        }
        u32::try_from(v).or_else(|_| malformed(format!("{v} does not fit in 32 bits")))
    }

    /// A float or integer as `f64`.
    pub(crate) fn f64(&mut self) -> Result<f64> {
        match self.peek()? {
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            _ => Ok(self.int()? as i64 as f64),
        }
    }

    fn len_of(&mut self, m: Marker) -> Result<usize> {
        Ok(match m {
            Marker::FixStr(n) | Marker::FixArray(n) | Marker::FixMap(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(self.be::<1>()?[0]),
            Marker::Str16 | Marker::Bin16 | Marker::Array16 | Marker::Map16 => {
                usize::from(u16::from_be_bytes(self.be()?))
            }
            Marker::Str32 | Marker::Bin32 | Marker::Array32 | Marker::Map32 => {
                u32::from_be_bytes(self.be()?) as usize
            }
            other => return malformed(format!("unexpected {other:?}")),
        })
    }

    /// A UTF-8 string.
    pub(crate) fn str(&mut self) -> Result<&'a str> {
        let m = self.marker()?;
        if !matches!(
            m,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        ) {
            return malformed(format!("expected a string, found {m:?}"));
        }
        let n = self.len_of(m)?;
        std::str::from_utf8(self.take(n)?).or_else(|_| malformed("string is not UTF-8"))
    }

    /// A binary value.
    pub(crate) fn bin(&mut self) -> Result<&'a [u8]> {
        let m = self.marker()?;
        if !matches!(m, Marker::Bin8 | Marker::Bin16 | Marker::Bin32) {
            return malformed(format!("expected binary, found {m:?}"));
        }
        let n = self.len_of(m)?;
        self.take(n)
    }

    /// An array header; returns the element count.
    pub(crate) fn array_len(&mut self) -> Result<usize> {
        let m = self.marker()?;
        if !matches!(m, Marker::FixArray(_) | Marker::Array16 | Marker::Array32) {
            return malformed(format!("expected an array, found {m:?}"));
        }
        let n = self.len_of(m)?;
        // Every element takes at least one byte: reject lengths the input cannot hold before
        // anything allocates for them.
        if n > self.remaining() {
            return malformed("array longer than the message");
        }
        Ok(n)
    }

    /// A map header; returns the entry count.
    pub(crate) fn map_len(&mut self) -> Result<usize> {
        let m = self.marker()?;
        if !matches!(m, Marker::FixMap(_) | Marker::Map16 | Marker::Map32) {
            return malformed(format!("expected a map, found {m:?}"));
        }
        let n = self.len_of(m)?;
        if n.saturating_mul(2) > self.remaining() {
            return malformed("map longer than the message");
        }
        Ok(n)
    }

    /// Skips one value of any kind.
    pub(crate) fn skip(&mut self) -> Result<()> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return malformed("nesting too deep");
        }
        let m = self.marker()?;
        let fixed = match m {
            Marker::Null | Marker::True | Marker::False | Marker::FixPos(_) | Marker::FixNeg(_) => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => 1 + usize::from(self.be::<1>()?[0]),
            Marker::Ext16 => 1 + usize::from(u16::from_be_bytes(self.be()?)),
            Marker::Ext32 => 1 + u32::from_be_bytes(self.be()?) as usize,
            Marker::FixStr(_)
            | Marker::Str8
            | Marker::Str16
            | Marker::Str32
            | Marker::Bin8
            | Marker::Bin16
            | Marker::Bin32 => self.len_of(m)?,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let n = self.len_of(m)?;
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
                0
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let n = self.len_of(m)?;
                for _ in 0..n.saturating_mul(2) {
                    self.skip_depth(depth + 1)?;
                }
                0
            }
            Marker::Reserved => return malformed("reserved msgpack marker"),
        };
        self.take(fixed).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        f(&mut out);
        out
    }

    #[test]
    fn integers_of_every_width() {
        for v in [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX) + 1,
            u64::MAX,
        ] {
            let bytes = encode(|o| {
                let _ = rmp::encode::write_uint(o, v);
            });
            assert_eq!(Reader::new(&bytes).int(), Ok(v));
        }
        for v in [-1i64, -32, -33, -200, -40_000, i64::MIN] {
            let bytes = encode(|o| {
                let _ = rmp::encode::write_sint(o, v);
            });
            assert_eq!(Reader::new(&bytes).int(), Ok(v as u64));
            assert!(Reader::new(&bytes).u32().is_err());
        }
    }

    #[test]
    fn skipping_walks_nested_values() {
        let bytes = encode(|o| {
            let _ = rmp::encode::write_array_len(o, 3);
            let _ = rmp::encode::write_map_len(o, 1);
            let _ = rmp::encode::write_str(o, "k");
            let _ = rmp::encode::write_bin(o, &[1, 2, 3]);
            let _ = rmp::encode::write_f64(o, 1.5);
            let _ = rmp::encode::write_ext_meta(o, 2, 7);
            o.extend_from_slice(&[9, 9]);
            let _ = rmp::encode::write_nil(o);
        });
        let mut r = Reader::new(&bytes);
        r.skip().expect("valid");
        assert_eq!(r.kind(), Ok(Kind::Nil));
        assert!(r.nil().expect("nil"));
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn truncation_and_lies_are_errors() {
        let bytes = encode(|o| {
            let _ = rmp::encode::write_str(o, "hello");
        });
        assert!(Reader::new(&bytes[..3]).str().is_err());
        let huge_array = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(Reader::new(&huge_array).array_len().is_err());
        assert!(Reader::new(&huge_array).skip().is_err());
        assert!(Reader::new(&[0xc1]).kind().is_err());
        assert!(Reader::new(&[]).int().is_err());
        let deep = vec![0x91; 100];
        assert!(Reader::new(&deep).skip().is_err());
    }
}
