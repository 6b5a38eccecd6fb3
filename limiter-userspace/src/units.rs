//! Numbers as people read them: thousands separators, decimal byte
//! units, and a period as a rate's denominator.

use std::time::Duration;

/// `1234567` -> `1,234,567`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes with a decimal unit: `1.5 MB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A unit of time as a rate's denominator: `s`, `min`, `h`, `day`, or `30s`.
pub fn per(period: Duration) -> String {
    match period.as_secs() {
        1 if period.subsec_nanos() == 0 => "s".into(),
        60 if period.subsec_nanos() == 0 => "min".into(),
        3600 if period.subsec_nanos() == 0 => "h".into(),
        86_400 if period.subsec_nanos() == 0 => "day".into(),
        _ => humantime::format_duration(period).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_have_units_and_separators() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1_500_000), "1.5 MB");
        assert_eq!(per(Duration::from_secs(60)), "min");
        assert_eq!(per(Duration::from_secs(30)), "30s");
    }
}
