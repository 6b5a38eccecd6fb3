//! Rate-limit response fields: the IETF `RateLimit-Policy` and `RateLimit`
//! fields (draft-ietf-httpapi-ratelimit-headers), the `X-RateLimit-*`
//! fields many clients still read, and `Retry-After` on refusals.

use http::{HeaderMap, HeaderValue};

use super::{Admission, Quota};

/// The policy's name in the IETF fields.
const POLICY: &str = "default";

/// Adds the fields that describe `admission` to a response's headers.
pub fn apply(headers: &mut HeaderMap, admission: &Admission) {
    let Some(p) = admission.quota else {
        return;
    };
    let mut set = |name: &'static str, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    };
    set("ratelimit-policy", policy_field(&p));
    set(
        "ratelimit",
        format!("\"{POLICY}\";r={};t={}", p.remaining, p.reset_secs),
    );
    set("x-ratelimit-limit", p.quota.to_string());
    set("x-ratelimit-remaining", p.remaining.to_string());
    set("x-ratelimit-reset", p.reset_secs.to_string());
    if !admission.allowed {
        set("retry-after", p.retry_after_secs.max(1).to_string());
    }
}

fn policy_field(p: &Quota) -> String {
    format!("\"{POLICY}\";q={};w={}", p.quota, p.window_secs)
}
