//! Layer-7 rules: request fields read and tried most specific first,
//! refused by the kernel, their errors, rules of the same match, and
//! concurrency limits.

use super::common::{error, parse};
use crate::rules::*;

const LAYER7: &str = r#"rules:
  - name: login
    match: { method: [post, PUT], host: API.example.com, path: /v1/login }
    key: [source, header:x-api-key]
    limit: { rate: 5, unit: minute }
  - name: free-tier
    match:
      path_prefix: /v1/
      headers:
        - { name: x-tier, equals: free }
        - { name: x-debug, present: false }
    key: header:x-api-key
    limit: { rate: 100, unit: second }
  - name: per-path
    match: { source: 10.0.0.0/8 }
    key: [source, path]
    limit: { rate: 10, unit: second }
"#;

#[test]
fn layer7_fields_are_read_and_tried_most_specific_first() {
    use crate::rules::request::{HeaderCondition, PathMatch};
    let set = parse(LAYER7).unwrap();
    let login = &set.rules[0];
    assert_eq!(
        login.request.methods,
        [http::Method::POST, http::Method::PUT]
    );
    assert_eq!(login.request.host.as_deref(), Some("api.example.com"));
    assert_eq!(
        login.request.path,
        Some(PathMatch::Exact("/v1/login".into()))
    );
    assert_eq!(login.key.v4, 32);
    assert_eq!(login.keyed_by.len(), 2);
    let free = &set.rules[1];
    assert_eq!(
        free.request.headers[1].condition,
        HeaderCondition::Absent,
        "present: false"
    );
    assert_eq!(
        free.keyed_by,
        [KeyPart::Header(http::HeaderName::from_static("x-api-key"))]
    );
    // Three conditions, then two, then none (whatever the source).
    assert_eq!(matching::match_order(&set), [0, 1, 2]);
    let described = describe::describe(login);
    assert_eq!(
        described.matches,
        "any source POST|PUT host api.example.com path /v1/login"
    );
    assert_eq!(described.key, "/32 v4, /128 v6 + header:x-api-key");
    // A rule's layer-7 fields are in its fingerprint: changed, its
    // buckets start over.
    let other = parse(&LAYER7.replace("/v1/login", "/v1/logout")).unwrap();
    assert_ne!(login.fingerprint(), other.rules[0].fingerprint());
}

#[test]
fn the_kernel_refuses_layer7_fields_and_keys() {
    let e = parse(LAYER7)
        .unwrap()
        .kernel_compatible()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rules[0] (\"login\"): match.method (a request's field) works at layer 7 only"),
        "{e}"
    );
    let keyed = "rules:\n  - { name: p, key: [source, path], limit: { rate: 1, unit: second } }\n";
    let e = parse(keyed)
        .unwrap()
        .kernel_compatible()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("key source + path (a request's fields) works at layer 7 only"),
        "{e}"
    );
    let plain = "rules:\n  - { name: p, key: source/24, match: { source: 10.0.0.0/8 }, limit: { rate: 1, unit: second } }\n";
    assert_eq!(parse(plain).unwrap().kernel_compatible(), Ok(()));
}

#[test]
fn bad_layer7_fields_name_their_line_and_field() {
    let rule = |fields: &str| {
        format!("rules:\n  - name: r\n    {fields}\n    limit: {{ rate: 1, unit: second }}\n")
    };
    let cases = [
        (
            "match: { method: \"GE T\", path: /a }",
            "rules[0].match.method: \"GE T\": not a method",
        ),
        (
            "match: { method: [] }",
            "rules[0].match.method: an empty list matches nothing",
        ),
        (
            "match: { host: \"example.com:80\" }",
            "rules[0].match.host: \"example.com:80\": expected a host name without a port",
        ),
        (
            "match: { path: v1 }",
            "rules[0].match.path: \"v1\": expected a path starting with /",
        ),
        (
            "match: { path: /a, path_prefix: /b }",
            "rules[0].match.path_prefix: give `path` (exact) or `path_prefix`, not both",
        ),
        (
            "match: { headers: [{ name: \"x y\" }] }",
            "rules[0].match.headers[0].name: \"x y\": not a header name",
        ),
        (
            "match: { headers: [{ name: x, equals: a, present: true }] }",
            "rules[0].match.headers[0].present: give `equals` or `present`, not both",
        ),
        (
            "key: [path, cookie]",
            "rules[0].key: \"cookie\": expected source, source/N, header:NAME, path, method, host or all",
        ),
        (
            "key: [source, source/24]",
            "rules[0].key: source: named twice",
        ),
    ];
    for (fields, expected) in cases {
        let e = error(&rule(fields));
        assert!(e.contains(expected), "{fields}: {e}");
        assert!(e.contains("rules.yaml:3"), "{fields}: no line 3 in {e}");
    }
    // Two rules that ask the same of a request cannot both apply.
    let twice = "rules:\n  - { name: a, match: { path: /x }, limit: { rate: 1, unit: second } }\n  - { name: b, match: { path: /x }, limit: { rate: 2, unit: second } }\n";
    assert!(error(twice).contains("same match as rules[0]"));
    let differ = twice.replace(
        "{ path: /x }, limit: { rate: 2",
        "{ path: /y }, limit: { rate: 2",
    );
    assert!(parse(&differ).is_ok());
}

/// Of rules with the same match, the first that can key a request applies
/// (a request without a header a rule is keyed by skips it): a rule after
/// one that keys every request it could is refused; one that keys requests
/// the rules before it skip is not.
#[test]
fn a_rule_of_the_same_match_is_refused_only_when_it_could_never_apply() {
    let with = |matches: &str, keys: &[&str]| {
        let mut text = String::from("rules:\n");
        for (i, key) in keys.iter().enumerate() {
            text.push_str(&format!(
                "  - {{ name: r{i}, match: {{ {matches} }}, key: {key}, limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        text
    };
    let file = |keys: &[&str]| with("path_prefix: /api/", keys);
    for text in [
        file(&["header:x-user", "source"]),
        file(&["[header:x-a, header:x-b]", "header:x-a", "source"]),
        file(&["[source, header:x-a]", "[source, host]", "source"]),
        file(&["host", "source"]),
        // Without layer-7 conditions, a caller that tells addresses alone
        // gives no path: the rule keyed by the address takes it.
        with("source: 10.0.0.0/8", &["path", "source"]),
        with(
            "headers: [{ name: x-a, present: false }]",
            &["header:x-b", "source"],
        ),
        // A header the match requires says nothing of another header.
        with(
            "headers: [{ name: x-b, present: true }]",
            &["header:x-a", "source"],
        ),
    ] {
        let set = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(set.rules.len() >= 2);
    }
    for (text, refused, first) in [
        (file(&["source", "header:x-user"]), 1, 0),
        (file(&["header:x-user", "header:x-user"]), 1, 0),
        (file(&["header:x-a", "[header:x-a, header:x-b]"]), 1, 0),
        (
            file(&["header:x-a", "header:x-b", "[header:x-b, header:x-c]"]),
            2,
            1,
        ),
        (file(&["[source, header:x-a]", "[header:x-a, path]"]), 1, 0),
        // Every request under a layer-7 condition has a path and a method.
        (file(&["path", "source"]), 1, 0),
        (file(&["[method, path]", "header:x-a"]), 1, 0),
        (with("source: 10.0.0.0/8", &["path", "header:x-a"]), 1, 0),
        // A header or host the match requires is always there.
        (
            with(
                "headers: [{ name: x-a, present: true }]",
                &["header:x-a", "source"],
            ),
            1,
            0,
        ),
        (
            with(
                "headers: [{ name: x-a, equals: v }]",
                &["header:x-a", "source"],
            ),
            1,
            0,
        ),
        (with("host: example.com", &["host", "source"]), 1, 0),
    ] {
        let e = error(&text);
        assert!(
            e.contains(&format!(
                "rules[{refused}].match: same match as rules[{first}] (\"r{first}\"), which keys every request this one could"
            )),
            "{text}: {e}"
        );
    }
}

#[test]
fn concurrency_limits_are_layer7_and_at_least_one() {
    let set =
        parse("rules:\n  - { name: d, key: header:x-user, limit: unlimited, concurrent: 3 }\n")
            .unwrap();
    assert_eq!(set.rules[0].concurrent, Some(3));
    assert_eq!(describe::describe(&set.rules[0]).limit, "3 in flight");
    let alone = parse("rules:\n  - { name: d, limit: { rate: 5, unit: second }, concurrent: 3 }\n")
        .unwrap();
    let e = alone.kernel_compatible().unwrap_err().to_string();
    assert!(
        e.contains("concurrent (requests in flight) works at layer 7 only"),
        "{e}"
    );
    let e = error("rules:\n  - { name: d, limit: unlimited, concurrent: 0 }\n");
    assert!(e.contains("rules[0].concurrent: must be at least 1"), "{e}");
    let e = error("rules:\n  - { name: d, key: path, limit: unlimited }\n");
    assert!(
        e.contains("rules[0].key: has no effect on an unlimited rule"),
        "{e}"
    );
}
