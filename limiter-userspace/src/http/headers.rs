//! Rate-limit response fields: the IETF `RateLimit-Policy` and `RateLimit`
//! fields (draft-ietf-httpapi-ratelimit-headers), the `X-RateLimit-*`
//! fields many clients still read, and `Retry-After` on refusals.

use http::{HeaderMap, HeaderValue};

use super::Admission;

/// Adds the fields that describe `admission` to a response's headers. The
/// policy is named after the rule that applied. `t`, `X-RateLimit-Reset`
/// and `Retry-After` are whole seconds, rounded up: the fields allow no
/// less, so a client may be told to wait 1 s when its next request would
/// conform in a millisecond.
pub fn apply(headers: &mut HeaderMap, admission: &Admission) {
    let Some(p) = admission.quota else {
        return;
    };
    let policy = sf_string(admission.rule.as_deref().unwrap_or("default"));
    let mut set = |name: &'static str, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    };
    set(
        "ratelimit-policy",
        format!("{policy};q={};w={}", p.quota, p.window_secs),
    );
    set(
        "ratelimit",
        format!("{policy};r={};t={}", p.remaining, p.reset_secs),
    );
    set("x-ratelimit-limit", p.quota.to_string());
    set("x-ratelimit-remaining", p.remaining.to_string());
    set("x-ratelimit-reset", p.reset_secs.to_string());
    if !admission.allowed {
        set("retry-after", p.retry_after_secs.max(1).to_string());
    }
}

/// `name` as a Structured Field string (RFC 8941): quoted, `"` and `\`
/// escaped, what is not printable ASCII replaced by `?`.
fn sf_string(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::sf_string;

    #[test]
    fn policy_names_are_structured_field_strings() {
        assert_eq!(sf_string("api"), "\"api\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
        assert_eq!(sf_string("café"), "\"caf?\"");
    }
}
