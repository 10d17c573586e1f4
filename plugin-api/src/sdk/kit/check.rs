//! The per-field checks `#[derive(ModelArgs)]` writes (`min`, `non_negative`, `positive`,
//! `even`, `one_of`), worded as [`crate::sdk::checks`] words them, for a field that holds one
//! value, an optional one or a list.

/// The values a field holds.
pub trait Values<T> {
    /// Every value (none for an absent option).
    fn each(&self) -> Vec<&T>;
}

macro_rules! values {
    ($($t:ty),*) => {$(
        impl Values<$t> for $t {
            fn each(&self) -> Vec<&$t> {
                vec![self]
            }
        }
        impl Values<$t> for Option<$t> {
            fn each(&self) -> Vec<&$t> {
                self.iter().collect()
            }
        }
        impl Values<$t> for Vec<$t> {
            fn each(&self) -> Vec<&$t> {
                self.iter().collect()
            }
        }
    )*};
}
values!(usize, f64, String);

/// Every value is at least `min`.
pub fn min(
    v: &impl Values<usize>,
    min: usize,
    prefix: &str,
    name: &str,
    hint: &str,
) -> Result<(), String> {
    match v.each().into_iter().find(|&&x| x < min) {
        Some(_) => Err(format!("{prefix}{name} must be at least {min}{hint}")),
        None => Ok(()),
    }
}

/// Every value is a finite number ≥ 0.
pub fn non_negative(
    v: &impl Values<f64>,
    prefix: &str,
    name: &str,
    hint: &str,
) -> Result<(), String> {
    match v
        .each()
        .into_iter()
        .find(|&&x| !(x >= 0.0 && x.is_finite()))
    {
        Some(x) => Err(format!(
            "{prefix}{name} = {x} must be a finite number ≥ 0{hint}"
        )),
        None => Ok(()),
    }
}

/// Every value is a finite number > 0.
pub fn positive(v: &impl Values<f64>, prefix: &str, name: &str, hint: &str) -> Result<(), String> {
    match v.each().into_iter().find(|&&x| !(x > 0.0 && x.is_finite())) {
        Some(x) => Err(format!(
            "{prefix}{name} = {x} must be a finite number > 0{hint}"
        )),
        None => Ok(()),
    }
}

/// Every value is even.
pub fn even(v: &impl Values<usize>, prefix: &str, name: &str, hint: &str) -> Result<(), String> {
    match v.each().into_iter().find(|&&x| x % 2 != 0) {
        Some(x) => Err(format!("{prefix}{name} ({x}) must be even{hint}")),
        None => Ok(()),
    }
}

/// Every value is one of `allowed`.
pub fn one_of(
    v: &impl Values<String>,
    allowed: &[&str],
    prefix: &str,
    name: &str,
) -> Result<(), String> {
    match v
        .each()
        .into_iter()
        .find(|x| !allowed.contains(&x.as_str()))
    {
        Some(x) => Err(format!(
            "{prefix}{name} must be one of {}, got '{x}'",
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}

/// Group-limited routing fits `n_experts`: `topk_group ≤ n_group`, the groups equal and of at
/// least two experts (a group scores its best two), and `top_k` experts reachable in the
/// `topk_group` groups a token may choose from. The messages name the fields as `what` does:
/// `[n_experts, top_k]` (a name with its key in parentheses, for instance).
pub fn group_routing(
    n_experts: usize,
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    [experts_name, top_k_name]: [&str; 2],
) -> Result<(), String> {
    if topk_group > n_group {
        return Err(format!(
            "topk_group ({topk_group}) must not exceed n_group ({n_group})"
        ));
    }
    if !n_experts.is_multiple_of(n_group) || (n_group > 1 && n_experts / n_group < 2) {
        return Err(format!(
            "n_group ({n_group}) must split the {n_experts} experts ({experts_name}) into equal groups of at least 2"
        ));
    }
    let reachable = topk_group * (n_experts / n_group);
    if top_k > reachable {
        return Err(format!(
            "{top_k_name} = {top_k} asks for more experts per token than the {reachable} experts of topk_group groups"
        ));
    }
    Ok(())
}
