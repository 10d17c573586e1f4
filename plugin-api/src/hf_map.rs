//! How one parameter is laid out in a Hugging Face checkpoint: which tensors hold it, how they
//! combine into one tensor, and the steps (a part of a fused tensor, a transpose) from that
//! tensor to ours. The host applies the steps on import and inverts them on export, so a
//! plugin states the mapping once and both directions follow.

use serde::{Deserialize, Serialize};

/// How a parameter's Hugging Face source tensors become one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HfCombine {
    /// One source tensor, taken as it is.
    #[default]
    One,
    /// One source per index of a new leading dim (per-expert tensors `experts.{e}.w` into one
    /// `[n_experts, ...]` parameter); export splits them back.
    Stack,
    /// Equal-sized sources joined along `dim` (separate `gate_proj` and `up_proj` fused into one
    /// parameter); export splits them back into equal parts.
    Concat {
        /// The dim they are joined along.
        dim: usize,
    },
}

/// One step from the combined Hugging Face tensor towards the parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HfStep {
    /// The parameter is part `index` of `parts` equal parts along `dim` (a fused `gate_up_proj`
    /// split into gate and up). `interleaved` takes every `parts`-th entry starting at `index`
    /// (GPT-OSS stores gate and up alternating) instead of a contiguous block. Only as the first
    /// step; export joins the parts of every parameter that names the same sources.
    Part {
        /// The dim that is split.
        dim: usize,
        /// Which part.
        index: usize,
        /// How many parts.
        parts: usize,
        /// Alternating entries rather than contiguous blocks.
        interleaved: bool,
    },
    /// Swap two dims (a weight stored `[in, out]` where we keep `[out, in]`).
    Transpose {
        /// One dim.
        a: usize,
        /// The other.
        b: usize,
    },
}

/// Where a parameter lives in a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HfMap {
    /// The Hugging Face tensor names, in order (one, or one per stacked/concatenated piece).
    pub sources: Vec<String>,
    /// How the sources become one tensor.
    #[serde(default)]
    pub combine: HfCombine,
    /// From that tensor to the parameter, applied in order on import, inverted on export.
    #[serde(default)]
    pub steps: Vec<HfStep>,
}

impl HfMap {
    /// The tensor named `hf`, as it is.
    pub fn one(hf: impl Into<String>) -> Self {
        HfMap {
            sources: vec![hf.into()],
            combine: HfCombine::One,
            steps: vec![],
        }
    }

    /// `n` tensors named by `template` with `{e}` replaced by `0..n`, stacked along a new dim 0.
    pub fn stack(template: &str, n: usize) -> Self {
        HfMap {
            sources: (0..n)
                .map(|e| template.replace("{e}", &e.to_string()))
                .collect(),
            combine: HfCombine::Stack,
            steps: vec![],
        }
    }

    /// `sources` of equal shape joined along `dim`.
    pub fn concat(sources: Vec<String>, dim: usize) -> Self {
        HfMap {
            sources,
            combine: HfCombine::Concat { dim },
            steps: vec![],
        }
    }

    /// Then take part `index` of `parts` along `dim` (see [`HfStep::Part`]).
    pub fn part(mut self, dim: usize, index: usize, parts: usize, interleaved: bool) -> Self {
        self.steps.push(HfStep::Part {
            dim,
            index,
            parts,
            interleaved,
        });
        self
    }

    /// Then swap dims `a` and `b`.
    pub fn transpose(mut self, a: usize, b: usize) -> Self {
        self.steps.push(HfStep::Transpose { a, b });
        self
    }

    /// `(index, parts)` when the parameter is one part of a fused tensor.
    pub fn part_of(&self) -> Option<(usize, usize)> {
        match self.steps.first() {
            Some(HfStep::Part { index, parts, .. }) => Some((*index, *parts)),
            _ => None,
        }
    }

    /// The shape every source tensor must have for a parameter of shape `param`, found by
    /// running the steps backwards; an error says which step does not fit.
    pub fn source_shape(&self, param: &[usize]) -> Result<Vec<usize>, String> {
        if self.sources.is_empty() {
            return Err("no Hugging Face tensor named".into());
        }
        let mut shape = param.to_vec();
        for (i, step) in self.steps.iter().enumerate().rev() {
            match *step {
                HfStep::Transpose { a, b } => {
                    if a >= shape.len() || b >= shape.len() {
                        return Err(format!(
                            "transpose of dims {a} and {b} on a {}-d tensor",
                            shape.len()
                        ));
                    }
                    shape.swap(a, b);
                }
                HfStep::Part {
                    dim, index, parts, ..
                } => {
                    if i != 0 {
                        return Err("a part step must come first".into());
                    }
                    if dim >= shape.len() || parts == 0 || index >= parts {
                        return Err(format!(
                            "part {index} of {parts} along dim {dim} of a {}-d tensor",
                            shape.len()
                        ));
                    }
                    shape[dim] *= parts;
                }
            }
        }
        let n = self.sources.len();
        match self.combine {
            HfCombine::One if n != 1 => Err(format!("{n} tensors named for a single one")),
            HfCombine::One => Ok(shape),
            HfCombine::Stack => {
                if shape.first() != Some(&n) {
                    return Err(format!(
                        "{n} tensors stacked into a leading dim of {:?}",
                        shape.first()
                    ));
                }
                Ok(shape[1..].to_vec())
            }
            HfCombine::Concat { dim } => {
                if dim >= shape.len() || !shape[dim].is_multiple_of(n) {
                    return Err(format!(
                        "{n} tensors joined along dim {dim} of shape {shape:?}"
                    ));
                }
                shape[dim] /= n;
                Ok(shape)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_shapes_follow_the_steps_backwards() {
        // GPT-OSS: gate_up_proj [E, D, 2F] interleaved; our gate is [E, F, D].
        let m = HfMap::one("gate_up_proj")
            .part(2, 0, 2, true)
            .transpose(1, 2);
        assert_eq!(m.source_shape(&[4, 6, 8]).unwrap(), vec![4, 8, 12]);
        let m = HfMap::stack("experts.{e}.w1.weight", 4);
        assert_eq!(m.sources[3], "experts.3.w1.weight");
        assert_eq!(m.source_shape(&[4, 6, 8]).unwrap(), vec![6, 8]);
        assert!(m
            .source_shape(&[3, 6, 8])
            .unwrap_err()
            .contains("4 tensors"));
        let m = HfMap::concat(vec!["gate".into(), "up".into()], 0);
        assert_eq!(m.source_shape(&[12, 8]).unwrap(), vec![6, 8]);
        let m = HfMap::one("x").transpose(0, 1).part(0, 0, 2, false);
        assert!(m.source_shape(&[2, 2]).unwrap_err().contains("first"));
    }
}
