//! Rotary position embeddings as the kernels apply them: which dimensions
//! rotate together, and how a checkpoint stretches the frequencies. The
//! model layer parses these from checkpoints; the backends compute with them.

/// A RoPE scaling whose parameters no kernel can use (not finite, not
/// positive, or an empty interpolation band); the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRopeScaling(pub String);

/// Which pairs of dimensions rotary embeddings rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): Meta's original checkpoints and llama2.c.
    Interleaved,
    /// Dimension i with i + head_dim/2 ("rotate half"): Hugging Face checkpoints.
    Half,
}

/// How a checkpoint stretches RoPE's frequencies beyond the context it was
/// pre-trained on. Each variant is exact for every position (none depends on
/// the sequence length), so a cached K stays valid as the sequence grows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: frequency `i` is `theta^(-2i/head_dim)`.
    #[default]
    None,
    /// Every frequency divided by `factor` (transformers' `"linear"`).
    Linear { factor: f32 },
    /// Llama 3.1's frequency-dependent scaling (transformers' `"llama3"`):
    /// wavelengths shorter than `original_max_position / high_freq_factor`
    /// are kept, those longer than `original_max_position / low_freq_factor`
    /// are stretched by `factor`, and those between are interpolated.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        /// The context length of pre-training.
        original_max_position: u32,
    },
}

impl RopeScaling {
    /// The rotation frequency (radians per position) of pair `i` of a head
    /// of `head_dim` elements, in f64 (angles reach 10^6 radians).
    pub fn inv_freq(self, theta: f32, i: usize, head_dim: usize) -> f64 {
        let base = f64::from(theta).powf(-((2 * i) as f64) / head_dim as f64);
        match self {
            Self::None => base,
            Self::Linear { factor } => base / f64::from(factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let (factor, low, high) = (
                    f64::from(factor),
                    f64::from(low_freq_factor),
                    f64::from(high_freq_factor),
                );
                let old = f64::from(original_max_position);
                let wavelen = 2.0 * std::f64::consts::PI / base;
                if wavelen < old / high {
                    base
                } else if wavelen > old / low {
                    base / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * base / factor + smooth * base
                }
            }
        }
    }

    /// Checks the parameters: finite, positive factors, and for Llama 3
    /// `low_freq_factor < high_freq_factor` (the interpolation divides by
    /// their difference) and a non-zero pre-training context.
    pub fn validate(self) -> Result<(), InvalidRopeScaling> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(InvalidRopeScaling(format!(
                    "RoPE scaling {name} {v} is not a positive number"
                )))
            }
        };
        match self {
            Self::None => Ok(()),
            Self::Linear { factor } => positive("factor", factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if low_freq_factor >= high_freq_factor {
                    return Err(InvalidRopeScaling(format!(
                        "llama3 RoPE scaling needs low_freq_factor {low_freq_factor} below \
                         high_freq_factor {high_freq_factor}"
                    )));
                }
                if original_max_position == 0 {
                    return Err(InvalidRopeScaling(
                        "llama3 RoPE scaling's original_max_position_embeddings is 0".to_string(),
                    ));
                }
                Ok(())
            }
        }
    }
}
