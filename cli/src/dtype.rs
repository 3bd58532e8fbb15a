//! Element types: of the KV cache (`--dtype`) and of the Mamba and Gated DeltaNet states
//! (`--mamba-cache-dtype`, `--mamba-ssm-cache-dtype`), as mori-tp, PyTorch, vLLM and SGLang
//! spell them.

use std::fmt;

/// An element type: of the KV cache, a conv state or an SSM state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp16,
    /// An 8-bit float whose format was not named.
    Fp8,
    Fp8E4m3,
    Fp8E5m2,
    Fp32,
}

/// What `--dtype` says: a type, or `auto` (the model's own, from its config.json).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeArg {
    Auto,
    Is(Dtype),
}

/// The spellings `--dtype` accepts, for messages and help.
pub const DTYPE_SPELLINGS: &str = "bf16 (bfloat16), fp16 (float16, half), fp8, fp8_e4m3 \
                                   (float8_e4m3fn, fp8_e4m3fnuz), fp8_e5m2 (float8_e5m2), fp32 \
                                   (float32, float) or auto";

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8 | Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
            Dtype::Fp32 => 4,
        }
    }

    /// A dtype as mori-tp, PyTorch (`torch.bfloat16`, `float8_e4m3fn`), vLLM and SGLang
    /// (`--dtype half`, `--kv-cache-dtype fp8_e5m2`) spell it, in any case.
    pub fn parse(text: &str) -> Option<Dtype> {
        let lower = text.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Some(match name {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp16" | "float16" | "half" | "f16" => Dtype::Fp16,
            "fp8" | "float8" => Dtype::Fp8,
            // The "fn" and "fnuz" (AMD) variants differ in NaN and zero encodings, not in size.
            "fp8_e4m3" | "fp8e4m3" | "e4m3" | "float8_e4m3fn" | "fp8_e4m3fn"
            | "float8_e4m3fnuz" | "fp8_e4m3fnuz" => Dtype::Fp8E4m3,
            "fp8_e5m2" | "fp8e5m2" | "e5m2" | "float8_e5m2" | "float8_e5m2fnuz"
            | "fp8_e5m2fnuz" => Dtype::Fp8E5m2,
            "fp32" | "float32" | "float" | "f32" => Dtype::Fp32,
            _ => return None,
        })
    }
}

/// Parses `--dtype`.
pub fn parse_dtype(text: &str) -> Result<DtypeArg, String> {
    if text.trim().eq_ignore_ascii_case("auto") {
        return Ok(DtypeArg::Auto);
    }
    Dtype::parse(text)
        .map(DtypeArg::Is)
        .ok_or_else(|| format!("not a KV-cache dtype mori-tp knows; use one of {DTYPE_SPELLINGS}"))
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::Fp32 => "fp32",
        })
    }
}
