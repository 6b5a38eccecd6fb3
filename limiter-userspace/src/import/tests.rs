use std::path::{Path, PathBuf};

use crate::rules::{Algorithm, KeyPart, Limit, RuleSet, request::PathMatch};

/// The conversion of `service`'s descriptors with `routes`' actions.
fn with_routes(service: &str, routes: &str) -> super::Conversion {
    super::envoy_text(
        service,
        Path::new("service.yaml"),
        Some((routes, Path::new("routes.yaml"))),
    )
    .unwrap()
}

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

#[test]
fn without_the_routes_only_addresses_convert() {
    let conversion = super::envoy(&example("envoy-ratelimit.yaml"), None).unwrap();
    let set = RuleSet::parse(&conversion.rules, Path::new("converted")).unwrap();
    assert_eq!(set.rules.len(), 3);
    let all = &set.rules[0];
    assert_eq!(
        (all.matches.source, all.algorithm),
        (None, Algorithm::FixedWindow)
    );
    let Limit::Metered {
        packets: Some(m), ..
    } = all.limit
    else {
        panic!("metered")
    };
    assert_eq!((m.rate, m.period.as_secs()), (10, 1));
    assert_eq!(set.rules[1].limit, Limit::Unlimited);
    assert!(set.rules[2].shadow);
    let skipped = &conversion.skipped;
    assert_eq!(skipped.len(), 6, "{skipped:#?}");
    assert!(skipped[0].starts_with("header_match=api: key \"header_match\" means what the route's rate_limits actions say: give them (--routes FILE)"), "{skipped:#?}");
    assert!(skipped[1].starts_with("remote_address=10.9.9.9 > path=/login: nested descriptors"));
    assert!(skipped[2].contains("unit \"month\""));
}

#[test]
fn with_the_routes_request_fields_and_nested_descriptors_convert() {
    let conversion = super::envoy(
        &example("envoy-ratelimit.yaml"),
        Some(&example("envoy-routes.yaml")),
    )
    .unwrap();
    let set = RuleSet::parse(&conversion.rules, Path::new("converted")).unwrap();
    let rule = |name: &str| {
        set.rules
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no rule {name} in\n{}", conversion.rules))
    };
    // header_value_match: its headers are the match; every value given,
    // one bucket for all.
    let api = rule("header-match-api");
    assert_eq!(api.request.methods, [http::Method::POST]);
    assert_eq!(api.request.path, Some(PathMatch::Prefix("/api/".into())));
    assert!(api.keyed_by.is_empty(), "key: all");
    // generic_key: the route's match, one bucket.
    let checkout = rule("generic-key-checkout");
    assert_eq!(
        checkout.request.path,
        Some(PathMatch::Prefix("/checkout".into()))
    );
    assert!(checkout.keyed_by.is_empty());
    // request_headers without a value: a key per header value; nested,
    // a key per header value and path.
    let x_api_key = KeyPart::Header(http::HeaderName::from_static("x-api-key"));
    let per_key = rule("api-key");
    assert_eq!(per_key.keyed_by, std::slice::from_ref(&x_api_key));
    assert_eq!(per_key.request.path, Some(PathMatch::Prefix("/v1/".into())));
    // Nested: the parent's key, the child's value as a condition.
    let upload = rule("api-key---path--v1-upload");
    assert_eq!(upload.keyed_by, [x_api_key]);
    assert_eq!(
        upload.request.path,
        Some(PathMatch::Exact("/v1/upload".into()))
    );
    // remote_address as before, from the virtual host's actions.
    assert_eq!(rule("remote-address").keyed_by, [KeyPart::Source]);
    let private = rule("remote-address-192-168-0-0");
    assert!(private.shadow);
    assert_eq!(
        private.keyed_by,
        [KeyPart::Source],
        "each address of the prefix"
    );
    // What cannot convert says why: /login is not under the route's /v1/,
    // and a month is no unit here.
    let skipped = conversion.skipped.join("\n");
    assert!(
        skipped.contains("remote_address=10.9.9.9 > path=/login (virtual host \"edge\", routes[1], rate_limits[2]): no request matches both path /login and prefix /v1/"),
        "{skipped}"
    );
    assert!(skipped.contains("unit \"month\""), "{skipped}");
    assert_eq!(conversion.skipped.len(), 2, "{skipped}");
    // Every converted rule is for layer 7 or both; the kernel refuses the
    // request fields.
    assert!(set.kernel_compatible().is_err());
}

#[test]
fn actions_that_do_not_convert_say_why() {
    let service = "descriptors:\n  - { key: header_match, value: x, rate_limit: { unit: second, requests_per_unit: 1 } }\n  - { key: destination_cluster, rate_limit: { unit: second, requests_per_unit: 1 } }\n  - { key: masked_remote_address, rate_limit: { unit: second, requests_per_unit: 1 } }\n";
    let routes = r#"virtual_hosts:
  - name: v
    domains: [a.example, b.example]
    rate_limits:
      - actions: [{ header_value_match: { descriptor_value: x, headers: [{ name: x-a, safe_regex_match: { regex: "a.*" } }] } }]
      - actions: [{ destination_cluster: {} }]
      - actions: [{ masked_remote_address: { v4_prefix_mask_len: 24 } }]
"#;
    let conversion = with_routes(service, routes);
    let skipped = conversion.skipped.join("\n");
    assert!(
        skipped.contains("domains [\"a.example\", \"b.example\"] are not one host name"),
        "{skipped}"
    );
    assert!(skipped.contains("header_match=x (virtual host \"v\", rate_limits[0]): header matcher on \"x-a\": only exact values"), "{skipped}");
    assert!(skipped.contains("destination_cluster (virtual host \"v\", rate_limits[1]): action destination_cluster: no request field"), "{skipped}");
    assert!(skipped.contains("masked_remote_address (virtual host \"v\", rate_limits[2]): masked_remote_address: a rule's key prefix is per address family"), "{skipped}");
    assert!(conversion.rules.contains("rules: []"));
}

/// Route matches a rule cannot say are refused with the reason, not
/// dropped (a rule without them would apply to more requests).
#[test]
fn route_matches_a_rule_cannot_say_are_refused_not_widened() {
    let service = "descriptors:\n  - { key: generic_key, value: g, rate_limit: { unit: second, requests_per_unit: 1 } }\n";
    for (route_match, reason) in [
        ("{ path_separated_prefix: /api }", "path_separated_prefix"),
        ("{ prefix: /api, case_sensitive: false }", "without case"),
        (
            "{ prefix: /api, query_parameters: [{ name: debug, present_match: true }] }",
            "also matches on query_parameters",
        ),
    ] {
        let routes = format!(
            "virtual_hosts:\n  - name: v\n    domains: [a.example]\n    routes:\n      - match: {route_match}\n        route: {{ rate_limits: [ {{ actions: [{{ generic_key: {{ descriptor_value: g }} }}] }} ] }}\n"
        );
        let conversion = with_routes(service, &routes);
        let skipped = conversion.skipped.join("\n");
        assert!(skipped.contains(reason), "{route_match}: {skipped}");
        assert!(
            conversion.rules.contains("rules: []"),
            "{route_match}: {}",
            conversion.rules
        );
    }
    // A plain prefix, case-sensitive as envoy's default: converted.
    let routes = "virtual_hosts:\n  - name: v\n    domains: [a.example]\n    routes:\n      - match: { prefix: /api, case_sensitive: true }\n        route: { rate_limits: [ { actions: [{ generic_key: { descriptor_value: g } }] } ] }\n";
    let conversion = with_routes(service, routes);
    assert!(conversion.skipped.is_empty(), "{:?}", conversion.skipped);
    assert!(
        conversion.rules.contains("path_prefix: \"/api\""),
        "{}",
        conversion.rules
    );
}

/// Envoy charges a request to every descriptor its route's actions make;
/// a rule file charges it to one rule. Two descriptors of one route (a
/// per-user and a per-address limit) would convert to rules of the same
/// match, of which a request with the header meets only the first: the
/// second is listed, not converted to a rule that would let such a
/// request escape the per-address limit.
#[test]
fn descriptors_a_request_meets_together_are_not_made_rules_it_meets_one_of() {
    let service = "descriptors:\n  - { key: user, rate_limit: { unit: second, requests_per_unit: 5 } }\n  - { key: remote_address, rate_limit: { unit: second, requests_per_unit: 10 } }\n";
    let routes = "virtual_hosts:\n  - name: v\n    domains: [a.example]\n    routes:\n      - match: { prefix: /api }\n        route: { rate_limits: [ { actions: [{ request_headers: { header_name: x-user, descriptor_key: user } }] }, { actions: [{ remote_address: {} }] } ] }\n";
    let conversion = with_routes(service, routes);
    let skipped = conversion.skipped.join("\n");
    assert!(
        skipped.contains("envoy charges a request to both descriptors, a rule file to one rule"),
        "{skipped}\n{}",
        conversion.rules
    );
    assert!(
        conversion.rules.contains("header:x-user"),
        "{}",
        conversion.rules
    );
    assert_eq!(conversion.skipped.len(), 1, "{skipped}");
}
