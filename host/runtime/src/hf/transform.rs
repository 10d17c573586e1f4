//! A parameter's [`HfMap`] applied to engine tensors: Hugging Face tensors into our parameter
//! (combine the sources, then the steps) and back (the steps inverted, then split into the
//! sources). Both directions are exact copies, so import then export round-trips bit for bit.

use anneal_engine::ops::{cat, stack};
use anneal_engine::Tensor;
use anneal_plugin_api::spec::{HfCombine, HfMap, HfStep, ParamSpec};
use std::collections::{BTreeMap, HashMap};

type R<T> = Result<T, String>;

fn e(err: anneal_engine::Error) -> String {
    err.to_string()
}

/// The mapping of `p`, or the identity onto a tensor of its own name.
pub fn map_of(p: &ParamSpec) -> HfMap {
    p.hf.clone().unwrap_or_else(|| HfMap::one(p.name.clone()))
}

/// Our parameter from its (already shape-checked) sources.
pub fn import(map: &HfMap, sources: &[Tensor]) -> R<Tensor> {
    let mut t = match map.combine {
        HfCombine::One => sources.first().cloned().ok_or("no source tensor")?,
        HfCombine::Stack => stack(sources, 0).map_err(e)?,
        HfCombine::Concat { dim } => cat(sources, dim as isize).map_err(e)?,
    };
    for step in &map.steps {
        t = match *step {
            HfStep::Transpose { a, b } => t.transpose(a as isize, b as isize).map_err(e)?,
            HfStep::Part {
                dim,
                index,
                parts,
                interleaved,
            } => take_part(&t, dim, index, parts, interleaved)?,
        };
    }
    t.contiguous().map_err(e)
}

/// Part `index` of `parts` along `dim`: a contiguous block, or every `parts`-th entry.
fn take_part(t: &Tensor, dim: usize, index: usize, parts: usize, interleaved: bool) -> R<Tensor> {
    let len = t.shape()[dim] / parts;
    if !interleaved {
        return t.narrow(dim as isize, index * len, len).map_err(e);
    }
    // [.., len · parts, ..] viewed as [.., len, parts, ..]: entry `index` of the new dim.
    let mut split = t.shape().to_vec();
    split.splice(dim..=dim, [len, parts]);
    let mut out = t.shape().to_vec();
    out[dim] = len;
    t.contiguous()
        .and_then(|c| c.reshape(&split))
        .and_then(|v| v.narrow(dim as isize + 1, index, 1))
        .and_then(|v| v.contiguous())
        .and_then(|v| v.reshape(&out))
        .map_err(e)
}

/// Every Hugging Face tensor of `params` by name, laid out as the mappings say. Parameters that
/// are parts of one fused tensor are joined back into it.
pub fn export(
    specs: &[ParamSpec],
    params: &HashMap<String, Tensor>,
) -> R<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    // Fused tensors: (sources, combine) -> (dim, parts, interleaved, pieces by index).
    type Pieces = (usize, usize, bool, BTreeMap<usize, Tensor>);
    let mut fused: BTreeMap<Vec<String>, (HfMap, Pieces)> = BTreeMap::new();
    for p in specs {
        let Some(t) = params.get(&p.name) else {
            continue;
        };
        let map = map_of(p);
        let mut t = t.clone();
        for step in map.steps.iter().rev() {
            if let HfStep::Transpose { a, b } = *step {
                t = t.transpose(a as isize, b as isize).map_err(e)?;
            }
        }
        match map.steps.first() {
            Some(&HfStep::Part {
                dim,
                index,
                parts,
                interleaved,
            }) => {
                let entry = fused
                    .entry(map.sources.clone())
                    .or_insert_with(|| (map.clone(), (dim, parts, interleaved, BTreeMap::new())));
                entry.1 .3.insert(index, t);
            }
            _ => split_sources(&map, &t, &mut out)?,
        }
    }
    for (sources, (map, (dim, parts, interleaved, pieces))) in fused {
        if pieces.len() != parts {
            return Err(format!(
                "'{}' is fused from {parts} parameters but only {} are present",
                sources.join("', '"),
                pieces.len()
            ));
        }
        let pieces: Vec<Tensor> = pieces.into_values().collect();
        let whole = if interleaved {
            // Stack after `dim` and merge the two: entry i of part k lands at i · parts + k.
            let s = stack(&pieces, dim as isize + 1).map_err(e)?;
            let mut shape = pieces[0].shape().to_vec();
            shape[dim] *= parts;
            s.reshape(&shape).map_err(e)?
        } else {
            cat(&pieces, dim as isize).map_err(e)?
        };
        split_sources(&map, &whole, &mut out)?;
    }
    Ok(out)
}

/// The combined tensor `t` split back into the sources of `map`.
fn split_sources(map: &HfMap, t: &Tensor, out: &mut BTreeMap<String, Tensor>) -> R<()> {
    let n = map.sources.len();
    let pieces: Vec<Tensor> = match map.combine {
        HfCombine::One => vec![t.clone()],
        HfCombine::Stack => {
            let inner = t.shape()[1..].to_vec();
            (0..n)
                .map(|i| {
                    t.narrow(0, i, 1)
                        .and_then(|x| x.contiguous()?.reshape(&inner))
                })
                .collect::<Result<_, _>>()
                .map_err(e)?
        }
        HfCombine::Concat { dim } => {
            let len = t.shape()[dim] / n;
            (0..n)
                .map(|i| t.narrow(dim as isize, i * len, len))
                .collect::<Result<_, _>>()
                .map_err(e)?
        }
    };
    for (name, piece) in map.sources.iter().zip(pieces) {
        out.insert(name.clone(), piece.contiguous().map_err(e)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::spec::{Init, ModelSpec, Placement};

    fn spec(name: &str, shape: &[usize], hf: HfMap) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: "f32".into(),
            init: Init::Zeros,
            placement: Placement::default(),
            layer: None,
            hf: Some(hf),
            trainable: true,
        }
    }

    fn iota(shape: &[usize], from: f32) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n).map(|i| from + i as f32).collect(), shape).unwrap()
    }

    fn import_all(specs: &[ParamSpec], hf: &BTreeMap<String, Tensor>) -> HashMap<String, Tensor> {
        specs
            .iter()
            .map(|p| {
                let m = map_of(p);
                let want = m.source_shape(&p.shape).unwrap();
                let src: Vec<Tensor> = m.sources.iter().map(|s| hf[s].clone()).collect();
                assert!(
                    src.iter().all(|t| t.shape() == want.as_slice()),
                    "{}",
                    p.name
                );
                (p.name.clone(), import(&m, &src).unwrap())
            })
            .collect()
    }

    /// Checks the mapping is consistent, imports `hf`, exports again, and returns the params.
    fn round_trip(specs: &[ParamSpec], hf: BTreeMap<String, Tensor>) -> HashMap<String, Tensor> {
        let model = ModelSpec {
            active_params: None,
            architecture: "t".into(),
            n_layers: 0,
            vocab_size: 1,
            max_seq_len: 1,
            flops_per_token: 0.0,
            context_flops_per_token: 0.0,
            params: specs.to_vec(),
            kv_cache: vec![],
            hf: None,
            parallel: Default::default(),
        };
        model.check().unwrap();
        let params = import_all(specs, &hf);
        let back = export(specs, &params).unwrap();
        assert_eq!(
            back.keys().collect::<Vec<_>>(),
            hf.keys().collect::<Vec<_>>()
        );
        for (k, v) in &hf {
            assert_eq!(back[k].shape(), v.shape(), "{k}");
            assert_eq!(back[k].to_vec_f32(), v.to_vec_f32(), "{k}");
        }
        params
    }

    #[test]
    fn per_expert_tensors_stack_into_one_parameter_and_split_back() {
        // Mixtral / Qwen3-MoE: experts.{e}.w1.weight [F, D] -> w1 [E, F, D].
        let specs = [spec(
            "w1",
            &[3, 4, 2],
            HfMap::stack("experts.{e}.w1.weight", 3),
        )];
        let hf: BTreeMap<_, _> = (0..3)
            .map(|e| {
                (
                    format!("experts.{e}.w1.weight"),
                    iota(&[4, 2], 100.0 * e as f32),
                )
            })
            .collect();
        let p = round_trip(&specs, hf.clone());
        let e2 = p["w1"].narrow(0, 2, 1).unwrap().contiguous().unwrap();
        assert_eq!(e2.to_vec_f32(), hf["experts.2.w1.weight"].to_vec_f32());
    }

    #[test]
    fn a_fused_gate_up_splits_into_two_parameters_and_fuses_back() {
        // Contiguous halves along dim 1 of [E, 2F, D] (transformers 5's fused gate_up_proj).
        let block = |i| HfMap::one("gate_up_proj").part(1, i, 2, false);
        let specs = [
            spec("gate", &[2, 3, 4], block(0)),
            spec("up", &[2, 3, 4], block(1)),
        ];
        let gu = iota(&[2, 6, 4], 0.0);
        let p = round_trip(
            &specs,
            BTreeMap::from([("gate_up_proj".to_string(), gu.clone())]),
        );
        let want_up = gu.narrow(1, 3, 3).unwrap().contiguous().unwrap();
        assert_eq!(p["up"].to_vec_f32(), want_up.to_vec_f32());

        // GPT-OSS: gate_up_proj [E, D, 2F] with gate and up alternating along the last dim,
        // and our weights kept [E, F, D]: gate[e, f, d] = gate_up[e, d, 2f].
        let alt = |i| {
            HfMap::one("gate_up_proj")
                .part(2, i, 2, true)
                .transpose(1, 2)
        };
        let specs = [
            spec("gate", &[2, 3, 4], alt(0)),
            spec("up", &[2, 3, 4], alt(1)),
        ];
        let gu = iota(&[2, 4, 6], 0.0);
        let p = round_trip(
            &specs,
            BTreeMap::from([("gate_up_proj".to_string(), gu.clone())]),
        );
        let (g, u, src) = (
            p["gate"].to_vec_f32(),
            p["up"].to_vec_f32(),
            gu.to_vec_f32(),
        );
        for (e, f, d) in [(0, 0, 0), (1, 2, 3), (0, 1, 2)] {
            assert_eq!(g[e * 12 + f * 4 + d], src[e * 24 + d * 6 + 2 * f]);
            assert_eq!(u[e * 12 + f * 4 + d], src[e * 24 + d * 6 + 2 * f + 1]);
        }
    }

    #[test]
    fn separate_tensors_fuse_into_one_parameter_and_split_back() {
        // Our fused w13 [2F, D] from HF's gate_proj and up_proj [F, D]; a transposed router.
        let specs = [
            spec(
                "w13",
                &[6, 2],
                HfMap::concat(vec!["gate_proj".into(), "up_proj".into()], 0),
            ),
            spec(
                "router",
                &[4, 3],
                HfMap::one("router.weight").transpose(0, 1),
            ),
        ];
        let hf = BTreeMap::from([
            ("gate_proj".to_string(), iota(&[3, 2], 0.0)),
            ("up_proj".to_string(), iota(&[3, 2], 50.0)),
            ("router.weight".to_string(), iota(&[3, 4], 0.0)),
        ]);
        let p = round_trip(&specs, hf.clone());
        assert_eq!(p["w13"].to_vec_f32()[6..], hf["up_proj"].to_vec_f32()[..]);
        assert_eq!(p["router"].to_vec_f32()[..3], [0.0, 4.0, 8.0]);
    }

    #[test]
    fn a_missing_part_is_named_on_export() {
        let specs = [spec(
            "gate",
            &[2, 2],
            HfMap::one("gate_up").part(0, 0, 2, false),
        )];
        let params = HashMap::from([("gate".to_string(), iota(&[2, 2], 0.0))]);
        let err = export(&specs, &params).unwrap_err();
        assert!(
            err.contains("'gate_up'") && err.contains("2 parameters"),
            "{err}"
        );
    }
}
