//! Checks every model plugin makes of its arguments, with one wording: the first value that
//! fails is named with what it should be.

/// Fails on the first of `values` that is 0: `<name> must be at least 1`.
pub fn at_least_one(values: &[(&str, usize)]) -> Result<(), String> {
    match values.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{name} must be at least 1")),
        None => Ok(()),
    }
}

/// Fails on the first of `values` that is not a finite number ≥ 0 (a negative epsilon or
/// coefficient, NaN, infinity): `<name> = <v> must be a finite number ≥ 0`.
pub fn finite_non_negative(values: &[(&str, f64)]) -> Result<(), String> {
    match values.iter().find(|(_, v)| !(*v >= 0.0 && v.is_finite())) {
        Some((name, v)) => Err(format!("{name} = {v} must be a finite number ≥ 0")),
        None => Ok(()),
    }
}

/// Fails on the first of `values` that is not a finite number > 0: `<name> = <v> must be a
/// finite number > 0`.
pub fn finite_positive(values: &[(&str, f64)]) -> Result<(), String> {
    match values.iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
        Some((name, v)) => Err(format!("{name} = {v} must be a finite number > 0")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bad_value_is_named() {
        assert!(at_least_one(&[("a", 1), ("b", 2)]).is_ok());
        assert_eq!(
            at_least_one(&[("a", 1), ("b", 0), ("c", 0)]).unwrap_err(),
            "b must be at least 1"
        );
        assert_eq!(
            finite_non_negative(&[("eps", 1e-5), ("coef", -1.0)]).unwrap_err(),
            "coef = -1 must be a finite number ≥ 0"
        );
        assert!(finite_non_negative(&[("eps", 0.0)]).is_ok());
        assert!(finite_non_negative(&[("eps", f64::NAN)]).is_err());
        assert_eq!(
            finite_positive(&[("alpha", 0.0)]).unwrap_err(),
            "alpha = 0 must be a finite number > 0"
        );
        assert!(finite_positive(&[("alpha", f64::INFINITY)]).is_err());
    }
}
