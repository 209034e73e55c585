//! Model-level MLA configuration: head counts, dims and the softmax scale.

use crate::error::{Error, Result};
use crate::types::{LATENT_DIM, MAX_HEADS, ROPE_DIM};

/// YaRN RoPE scaling parameters that change the softmax scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope_scaling.factor` (DeepSeek-V3: 40).
    pub factor: f64,
    /// `rope_scaling.mscale_all_dim` (DeepSeek-V3: 1).
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// `0.1 · mscale_all_dim · ln(factor) + 1`, or 1 when `factor <= 1`.
    pub fn mscale(&self) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * self.mscale_all_dim * self.factor.ln() + 1.0
        }
    }
}

/// The attention shape of an MLA model, as its `config.json` gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// Query heads (of the whole model, or per GPU after [`MlaConfig::tensor_parallel`]).
    pub num_heads: usize,
    /// `qk_nope_head_dim` (DeepSeek-V3: 128, GLM-5: 192): only enters the softmax scale.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`: must be 64.
    pub qk_rope_head_dim: usize,
    /// `kv_lora_rank`: must be 512.
    pub kv_lora_rank: usize,
    /// YaRN scaling, if the model uses it.
    pub yarn: Option<Yarn>,
    /// A softmax scale that replaces the derived one.
    pub explicit_softmax_scale: Option<f32>,
}

impl MlaConfig {
    /// GLM-5 (`glm_moe_dsa`): 64 heads, nope 192, rope 64, rank 512, scale 1/16.
    pub fn glm5() -> MlaConfig {
        MlaConfig {
            num_heads: 64,
            qk_nope_head_dim: 192,
            qk_rope_head_dim: ROPE_DIM,
            kv_lora_rank: LATENT_DIM,
            yarn: None,
            explicit_softmax_scale: None,
        }
    }

    /// DeepSeek-V3 / V3.2: 128 heads, nope 128, rope 64, rank 512, YaRN factor 40 (×1.874).
    pub fn deepseek_v3() -> MlaConfig {
        MlaConfig {
            num_heads: 128,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: ROPE_DIM,
            kv_lora_rank: LATENT_DIM,
            yarn: Some(Yarn {
                factor: 40.0,
                mscale_all_dim: 1.0,
            }),
            explicit_softmax_scale: None,
        }
    }

    /// The scale applied to `q·k`: the explicit one, else `mscale² / sqrt(nope + rope)`.
    pub fn softmax_scale(&self) -> f32 {
        if let Some(s) = self.explicit_softmax_scale {
            return s;
        }
        let mscale = self.yarn.map_or(1.0, |y| y.mscale());
        let qk_dim = (self.qk_nope_head_dim + self.qk_rope_head_dim) as f64;
        (mscale * mscale / qk_dim.sqrt()) as f32
    }

    /// The same configuration with an explicit softmax scale.
    pub fn with_softmax_scale(self, scale: f32) -> MlaConfig {
        MlaConfig {
            explicit_softmax_scale: Some(scale),
            ..self
        }
    }

    /// Heads each GPU handles at tensor parallelism `tp` (must divide, and give 1..=128).
    pub fn heads_per_gpu(&self, tp: usize) -> Result<usize> {
        if tp == 0 || self.num_heads % tp != 0 {
            return Err(Error::invalid(
                "tp",
                format!("{tp} does not divide num_heads {}", self.num_heads),
            ));
        }
        let heads = self.num_heads / tp;
        if !(1..=MAX_HEADS).contains(&heads) {
            return Err(Error::invalid(
                "tp",
                format!("gives {heads} heads per GPU, outside 1..={MAX_HEADS}"),
            ));
        }
        Ok(heads)
    }

    /// The per-GPU configuration at tensor parallelism `tp` (same scale, fewer heads).
    pub fn tensor_parallel(&self, tp: usize) -> Result<MlaConfig> {
        Ok(MlaConfig {
            num_heads: self.heads_per_gpu(tp)?,
            ..*self
        })
    }

    /// Checks that the kernels can run this configuration (rank 512, rope 64, 1..=128 heads).
    pub fn check(&self) -> Result<()> {
        if self.kv_lora_rank != LATENT_DIM {
            return Err(Error::invalid(
                "kv_lora_rank",
                format!("{} (the kernels need {LATENT_DIM})", self.kv_lora_rank),
            ));
        }
        if self.qk_rope_head_dim != ROPE_DIM {
            return Err(Error::invalid(
                "qk_rope_head_dim",
                format!("{} (the kernels need {ROPE_DIM})", self.qk_rope_head_dim),
            ));
        }
        if !(1..=MAX_HEADS).contains(&self.num_heads) {
            return Err(Error::invalid(
                "num_heads",
                format!("{} outside 1..={MAX_HEADS}", self.num_heads),
            ));
        }
        crate::validate::softmax_scale(self.softmax_scale())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm5_scale_is_one_sixteenth() {
        assert_eq!(MlaConfig::glm5().softmax_scale(), 1.0 / 16.0);
        assert_eq!(MlaConfig::glm5().check(), Ok(()));
    }

    #[test]
    fn deepseek_scale() {
        let c = MlaConfig::deepseek_v3();
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((m * m - 1.874).abs() < 1e-3, "{}", m * m);
        let want = (m * m / 192f64.sqrt()) as f32;
        assert_eq!(c.softmax_scale(), want);
        assert!((c.softmax_scale() - 0.135_24).abs() < 1e-4);
        assert_eq!(c.with_softmax_scale(0.5).softmax_scale(), 0.5);
    }

    #[test]
    fn tensor_parallel() {
        assert_eq!(MlaConfig::glm5().heads_per_gpu(8), Ok(8));
        assert_eq!(
            MlaConfig::deepseek_v3()
                .tensor_parallel(8)
                .unwrap()
                .num_heads,
            16
        );
        assert!(MlaConfig::glm5().tensor_parallel(3).is_err());
        assert!(MlaConfig::glm5().tensor_parallel(0).is_err());
        let wide = MlaConfig {
            num_heads: 256,
            ..MlaConfig::glm5()
        };
        assert!(wide.tensor_parallel(1).is_err());
        assert_eq!(wide.heads_per_gpu(2), Ok(128));
        assert!(wide.check().is_err());
    }
}
