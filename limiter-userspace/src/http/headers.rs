//! Rate-limit response fields: the IETF `RateLimit-Policy` and `RateLimit`
//! fields (draft-ietf-httpapi-ratelimit-headers), the `X-RateLimit-*`
//! fields many clients still read, and `Retry-After` on refusals.

use http::{HeaderMap, HeaderName, HeaderValue};

use limiter_common::trace::reason;

use super::decision::{Decision, Quota};
use crate::rules::{Limit, Rule};

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// Names the rule whose soft limit the request went over (it was served).
const X_RATELIMIT_OVER_SOFT: HeaderName = HeaderName::from_static("x-ratelimit-over-soft");

/// What a rule's responses always say, written once per rule.
pub struct RuleFields {
    /// The rule's name as a Structured Field string.
    name: String,
    /// `RateLimit-Policy` and `X-RateLimit-Limit`, for a packet limit.
    policy: Option<(HeaderValue, HeaderValue)>,
}

impl RuleFields {
    pub(super) fn of(rule: &Rule) -> Self {
        let name = sf_string(&rule.name);
        let policy = match rule.limit {
            Limit::Metered {
                packets: Some(m), ..
            } => {
                let window = m.period.as_secs().max(1);
                let policy = format!("{name};q={};w={window}", m.rate);
                HeaderValue::from_str(&policy)
                    .ok()
                    .map(|policy| (policy, HeaderValue::from(m.rate)))
            }
            _ => None,
        };
        Self { name, policy }
    }
}

/// The fields that describe `decision`, for its response: from what the
/// rule that applied always says (`rule`: `None`, the default) and its
/// key's `quota` as the request left it (`Limiter::quota`). The policy is
/// named after the rule. `t`,
/// `X-RateLimit-Reset` and `Retry-After` are whole seconds, rounded up:
/// the fields allow no less, so a client may be told to wait 1 s when its
/// next request would conform in a millisecond.
pub fn fields(decision: &Decision, rule: Option<&RuleFields>, quota: Option<Quota>) -> Fields {
    let mut fields = Fields::default();
    if decision.blocked_for_ns > 0 {
        // Blocked by escalation: no meter to describe, only the wait.
        let secs = decision.blocked_for_ns.div_ceil(1_000_000_000);
        fields.0[5] = Some((http::header::RETRY_AFTER, HeaderValue::from(secs)));
        return fields;
    }
    if decision.over_soft
        && let Some(rule) = rule
    {
        fields.0[6] = HeaderValue::from_str(&rule.name)
            .ok()
            .map(|name| (X_RATELIMIT_OVER_SOFT, name));
    }
    let (Some(rule), Some(p)) = (rule, quota) else {
        // Refused with no meter to say when: too many in flight, or no
        // room for a new key. A second is a hint, not a promise; a request
        // no rule admits (`default: block`) is told nothing (retrying
        // will not help).
        let hint = matches!(
            decision.refused_by,
            Some(reason::IN_FLIGHT | reason::NO_SLOT)
        );
        if !decision.allowed && hint {
            fields.0[5] = Some((http::header::RETRY_AFTER, HeaderValue::from(1u64)));
        }
        return fields;
    };
    let Some((policy, limit)) = &rule.policy else {
        return fields;
    };
    let over_soft = fields.0[6].take();
    fields.0 = [
        Some((RATELIMIT_POLICY, policy.clone())),
        Some((
            RATELIMIT,
            written(format_args!(
                "{};r={};t={}",
                rule.name, p.remaining, p.reset_secs
            )),
        )),
        Some((X_RATELIMIT_LIMIT, limit.clone())),
        Some((X_RATELIMIT_REMAINING, HeaderValue::from(p.remaining))),
        Some((X_RATELIMIT_RESET, HeaderValue::from(p.reset_secs))),
        (!decision.allowed).then(|| {
            (
                http::header::RETRY_AFTER,
                HeaderValue::from(p.retry_after_secs.max(1)),
            )
        }),
        over_soft,
    ];
    fields
}

/// A response's rate-limit fields, computed when its request was judged.
#[derive(Default)]
pub struct Fields([Option<(HeaderName, HeaderValue)>; 7]);

impl Fields {
    pub fn apply(self, headers: &mut HeaderMap) {
        for (name, value) in self.0.into_iter().flatten() {
            headers.insert(name, value);
        }
    }

    /// Whether these fields set `name` (any case): an answer's own field
    /// of that name gives way to them.
    pub fn sets(&self, name: &[u8]) -> bool {
        // All start with r or x: most names are known not set at once.
        if !matches!(name.first().map(u8::to_ascii_lowercase), Some(b'r' | b'x')) {
            return false;
        }
        self.0
            .iter()
            .flatten()
            .any(|(set, _)| set.as_str().as_bytes().eq_ignore_ascii_case(name))
    }

    /// Writes them as HTTP/1.1 field lines.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        for (name, value) in self.0.iter().flatten() {
            write_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
}

/// Writes one HTTP/1.1 field line.
pub(crate) fn write_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A field value written without a `String` in between.
pub(crate) fn written(args: std::fmt::Arguments<'_>) -> HeaderValue {
    use std::io::Write;
    let mut buf = [0u8; 128];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    let n = match cursor.write_fmt(args) {
        Ok(()) => cursor.position() as usize,
        Err(_) => return HeaderValue::from_static(""),
    };
    HeaderValue::from_bytes(&buf[..n]).unwrap_or_else(|_| HeaderValue::from_static(""))
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
