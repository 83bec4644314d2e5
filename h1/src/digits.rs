//! Numbers written into heads and chunk lines without `fmt` machinery.

/// Appends `n` in decimal.
#[inline]
pub fn push_decimal(out: &mut Vec<u8>, n: usize) {
    push_radix(out, n, 10);
}

/// Appends `n` in lowercase hexadecimal (chunk sizes).
#[inline]
pub fn push_hex(out: &mut Vec<u8>, n: usize) {
    push_radix(out, n, 16);
}

/// Appends `n` in base `radix` (at most 16).
#[inline]
fn push_radix(out: &mut Vec<u8>, mut n: usize, radix: usize) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 20];
    let mut start = buf.len();
    loop {
        start -= 1;
        buf[start] = DIGITS[n % radix];
        n /= radix;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_match_fmt() {
        for n in [0, 1, 9, 10, 15, 16, 255, 4096, 123_456_789, usize::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
            out.clear();
            push_hex(&mut out, n);
            assert_eq!(out, format!("{n:x}").as_bytes());
        }
    }
}
