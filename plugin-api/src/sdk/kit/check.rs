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
