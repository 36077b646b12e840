//! [`F8E4M3`]: the 8-bit KV element (OCP FP8 E4M3, the "fn" variant: no
//! infinities, one NaN pattern per sign), converted exactly as a CUDA
//! device's `cvt.rn.satfinite.e4m3x2.f32` converts, so that a page appended
//! on the host and one appended by a kernel hold the same bytes.
//!
//! Layout: sign, 4 exponent bits (bias 7), 3 mantissa bits. Largest finite
//! magnitude 448, smallest normal 2^-6, smallest subnormal 2^-9.
//!
//! From f32: round to nearest, ties to even; a magnitude past 448 (infinity
//! included) saturates to ±448 (`satfinite`); NaN becomes the canonical NaN
//! `0x7F`. Values are stored unscaled: a model whose keys or values exceed
//! ±448 loses them to saturation, so it should keep a 16-bit KV dtype.
//!
//! Written here rather than taken from a crate: the `float8` crate follows
//! `ml_dtypes`, where an overflow becomes NaN, and the pages must hold what
//! the device's saturating conversion stores.

/// Every code's value, decoded once at compile time by [`decode`].
static TO_F32: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = decode(b as u8);
        b += 1;
    }
    t
};

/// The value of code `b`: sign, 4 exponent bits (bias 7), 3 mantissa bits;
/// exponent 0 is subnormal (m x 2^-9), all ones with mantissa 7 is NaN.
const fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = (b >> 3) & 0xF;
    let m = b & 7;
    if e == 0xF && m == 7 {
        return if sign < 0.0 { -f32::NAN } else { f32::NAN };
    }
    if e == 0 {
        return sign * (m as f32) * (1.0 / 512.0);
    }
    let bits = ((e as u32) + 127 - 7) << 23 | (m as u32) << 20;
    sign * f32::from_bits(bits)
}

/// One FP8 E4M3 value (its bits).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct F8E4M3(pub u8);

impl F8E4M3 {
    /// Zero.
    pub const ZERO: F8E4M3 = F8E4M3(0);
    /// The canonical NaN (what a NaN input converts to).
    pub const NAN: F8E4M3 = F8E4M3(0x7F);
    /// The largest finite value, 448.
    pub const MAX: F8E4M3 = F8E4M3(0x7E);

    /// The value as f32 (exact: every E4M3 value is an f32), from a
    /// 256-entry table: CPU attention widens every KV element it reads.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        TO_F32[self.0 as usize]
    }

    /// `x` rounded to nearest (ties to even), saturated to ±448, NaN to
    /// the canonical NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> F8E4M3 {
        if x.is_nan() {
            return F8E4M3::NAN;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        if a >= 448.0 {
            return F8E4M3(sign | F8E4M3::MAX.0);
        }
        if a < 1.0 / 64.0 {
            // Subnormal range (or the smallest normal, by rounding up): the
            // code is the count of 2^-9 steps, and 8 steps is the code of
            // 2^-6. Scaling by a power of two is exact here.
            let q = (a * 512.0).round_ties_even() as u8;
            return F8E4M3(sign | q);
        }
        let bits = a.to_bits();
        let exp = (bits >> 23) as i32 - 127; // -6..=8
        let mant = bits & 0x7F_FFFF;
        let kept = mant >> 20;
        let rest = mant & 0xF_FFFF;
        let half = 0x8_0000;
        let up = rest > half || (rest == half && kept & 1 == 1);
        // A carry out of the mantissa moves into the exponent, as it should;
        // a < 448 keeps the result at most 448 (code 0x7E).
        let code = (((exp + 7) as u32) << 3 | kept) + u32::from(up);
        F8E4M3(sign | code.min(u32::from(F8E4M3::MAX.0)) as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::F8E4M3;

    /// Every finite code, with its value, in increasing order of value.
    fn finite_codes() -> Vec<(u8, f32)> {
        let mut v: Vec<(u8, f32)> = (0..=255u8)
            .map(|b| (b, F8E4M3(b).to_f32()))
            .filter(|(_, x)| !x.is_nan())
            .collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        v
    }

    /// The reference conversion: the nearest finite value by search, ties to
    /// the even code, beyond the largest the largest (satfinite).
    fn nearest(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let codes = finite_codes();
        // Past the largest finite value: the largest (satfinite).
        let x = f64::from(x).clamp(-448.0, 448.0);
        let mut best = codes[0];
        for &(b, v) in &codes {
            let (d, db) = ((f64::from(v) - x).abs(), (f64::from(best.1) - x).abs());
            if d < db || (d == db && b & 1 == 0 && best.0 & 1 == 1) {
                best = (b, v);
            }
        }
        // -0.0 and 0.0 are equally near a zero input: keep its sign.
        if best.1 == 0.0 {
            return if x.is_sign_negative() { 0x80 } else { 0 };
        }
        best.0
    }

    #[test]
    fn every_code_has_the_value_the_format_defines() {
        assert_eq!(F8E4M3(0x7E).to_f32(), 448.0);
        assert_eq!(F8E4M3(0xFE).to_f32(), -448.0);
        assert_eq!(F8E4M3(0x08).to_f32(), 1.0 / 64.0, "smallest normal");
        assert_eq!(F8E4M3(0x01).to_f32(), 1.0 / 512.0, "smallest subnormal");
        assert_eq!(F8E4M3(0x38).to_f32(), 1.0);
        assert_eq!(F8E4M3(0x39).to_f32(), 1.125);
        assert!(F8E4M3(0x7F).to_f32().is_nan() && F8E4M3(0xFF).to_f32().is_nan());
        // 254 finite codes (two zeros), all distinct but the zeros.
        let codes = finite_codes();
        assert_eq!(codes.len(), 254);
        for w in codes.windows(2) {
            assert!(w[0].1 < w[1].1 || (w[0].1 == 0.0 && w[1].1 == 0.0));
        }
        // Every code (the table `to_f32` reads) against the definition,
        // computed here in f64: sign x 2^(e-7) x 1.m, or m x 2^-9 for
        // exponent 0; exponent 15 with mantissa 7 is NaN.
        for b in 0..=255u8 {
            let sign = if b & 0x80 != 0 { -1.0f64 } else { 1.0 };
            let (e, m) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
            let got = F8E4M3(b).to_f32();
            if e == 15 && m == 7.0 {
                assert!(got.is_nan(), "code {b:#04x}");
                assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "NaN sign, {b:#04x}");
                continue;
            }
            let want = if e == 0 {
                sign * m * 2f64.powi(-9)
            } else {
                sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            assert_eq!(f64::from(got), want, "code {b:#04x}");
            assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "sign of {b:#04x}");
        }
    }

    #[test]
    fn every_finite_code_round_trips() {
        for (b, v) in finite_codes() {
            assert_eq!(F8E4M3::from_f32(v).0, b, "code {b:#04x} = {v}");
        }
    }

    #[test]
    fn ties_go_to_the_even_code_and_one_ulp_off_a_tie_goes_to_the_nearer() {
        let codes = finite_codes();
        for w in codes.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            if lo.1 == hi.1 {
                continue; // the two zeros
            }
            let mid = (f64::from(lo.1) + f64::from(hi.1)) / 2.0;
            let mid = mid as f32; // exact: E4M3 midpoints have few bits
            let even = if lo.0 & 1 == 0 { lo.0 } else { hi.0 };
            assert_eq!(
                F8E4M3::from_f32(mid).0,
                even,
                "tie between {} and {}",
                lo.1,
                hi.1
            );
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            let (below, above) = if mid > 0.0 {
                (below, above)
            } else {
                (above, below)
            };
            assert_eq!(F8E4M3::from_f32(below).0, lo.0, "just below {mid}");
            assert_eq!(F8E4M3::from_f32(above).0, hi.0, "just above {mid}");
        }
    }

    #[test]
    fn magnitudes_past_448_saturate_and_nan_stays_nan() {
        for x in [448.0f32, 449.0, 464.0, 500.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(F8E4M3::from_f32(x), F8E4M3::MAX, "{x}");
            assert_eq!(F8E4M3::from_f32(-x).0, 0xFE, "-{x}");
        }
        assert_eq!(F8E4M3::from_f32(f32::NAN), F8E4M3::NAN);
        assert_eq!(F8E4M3::from_f32(-f32::NAN), F8E4M3::NAN);
        assert_eq!(F8E4M3::from_f32(1e-30).0, 0, "underflow to +0");
        assert_eq!(F8E4M3::from_f32(-1e-30).0, 0x80, "underflow to -0");
    }

    #[test]
    fn any_f32_converts_to_the_nearest_code() {
        // A deterministic sweep of f32 bit patterns across every exponent.
        let mut bits = 0x9E37_79B9u32;
        for _ in 0..20_000 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let any = f32::from_bits(bits);
            // And one with its exponent in E4M3's range (2^-12 to 2^12).
            let near = f32::from_bits((bits & 0x807F_FFFF) | (115 + (bits >> 23) % 25) << 23);
            for x in [any, near] {
                assert_eq!(
                    F8E4M3::from_f32(x).0,
                    nearest(x),
                    "{x:e} ({:#010x})",
                    x.to_bits()
                );
            }
        }
    }
}
