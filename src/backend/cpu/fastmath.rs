//! A branch-free `exp` the compiler can vectorise (Cephes' single-precision
//! polynomial, about 1 ulp on the reduced range). Softmax and SiLU spend
//! most of their time in `exp`; libm's scalar call is several times slower.

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
pub(crate) const ROUND: f32 = 12_582_912.0;
/// The clamp of the argument.
pub(crate) const EXP_MIN: f32 = -87.3;
pub(crate) const EXP_MAX: f32 = 88.3;
/// The polynomial's coefficients, highest degree first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x`, clamped to the normal f32 range (`exp(-100)` gives ~1e-38, not 0;
/// `exp(100)` gives ~2e38, not infinity).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let big = x * LOG2E + ROUND;
    // The rounded integer sits in the low mantissa bits of `big`: integer
    // arithmetic on the bits (a float-to-int cast would not vectorise).
    let ni = big.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let n = big - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((ni + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_libm_to_a_few_ulp_over_the_useful_range() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (super::exp(x), x.exp());
            assert!(((a - b) / b).abs() < 4e-7, "exp({x}) = {a}, libm {b}");
            x += 0.0137;
        }
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) >= 0.0 && super::exp(-1000.0) < 1e-37);
        assert!(super::exp(1000.0).is_finite());
    }
}
