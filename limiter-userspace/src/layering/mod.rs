//! The layering of `docs/architecture.md`, held by a test: the imports
//! between the crate's top-level modules are read from the sources (every
//! `crate::` path outside comments, strings and test code) and each must
//! run down the page's floors; any that does not, and any cycle, fails.
//! Imports the page lists as known violations are let through until they
//! are gone, and the list may only shrink: one that no longer happens
//! fails too. Inside each module, its own file and its children import
//! one another without a cycle (`inner`); no source file is over 600
//! lines (`sizes`); the sources are read as code only (`source`).

mod inner;
mod sizes;
mod source;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use source::{code_only, without_tests};

/// Top-level module -> the top-level modules it imports, each with one
/// place (`file:line`) that does.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The page's floors (module -> floor) and its known violations.
struct Page {
    floors: BTreeMap<String, u32>,
    known: BTreeSet<(String, String)>,
}

/// Reads the page's `floors` block (`N: module module ...`, one floor a
/// line) and its `known-violations` block (`from -> to`, one a line).
fn parse_page(text: &str) -> Result<Page, String> {
    let block = |name: &str| -> Result<Vec<&str>, String> {
        let open = format!("```{name}\n");
        let start = text
            .find(&open)
            .ok_or_else(|| format!("no ```{name} block"))?
            + open.len();
        let end = text[start..]
            .find("```")
            .ok_or_else(|| format!("the ```{name} block is not closed"))?;
        Ok(text[start..start + end]
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect())
    };
    let mut floors = BTreeMap::new();
    for line in block("floors")? {
        let (floor, modules) = line
            .split_once(':')
            .ok_or_else(|| format!("floors: {line:?} is not `N: modules`"))?;
        let floor: u32 = floor
            .trim()
            .parse()
            .map_err(|_| format!("floors: {floor:?} is not a number"))?;
        for module in modules.split_whitespace() {
            if floors.insert(module.to_owned(), floor).is_some() {
                return Err(format!("floors: {module} is on two floors"));
            }
        }
    }
    let mut known = BTreeSet::new();
    for line in block("known-violations")? {
        let (from, to) = line
            .split_once("->")
            .ok_or_else(|| format!("known-violations: {line:?} is not `from -> to`"))?;
        known.insert((from.trim().to_owned(), to.trim().to_owned()));
    }
    Ok(Page { floors, known })
}

/// The top-level modules `code` names after `crate::`, each with its line:
/// `crate::engine::X` gives `engine`; a group, `crate::{engine::X,
/// kernel::{Y, Z}}`, each of its items' first segment.
fn crate_imports(code: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = code;
    let mut offset = 0;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + "crate::".len()..];
        let line = code[..offset + at].matches('\n').count() + 1;
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            let after = after.trim_start();
            if let Some(group) = after.strip_prefix('{') {
                // The group's items at depth 0.
                let mut depth = 0;
                let mut item_start = true;
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => item_start = true,
                        c if c.is_whitespace() => {}
                        _ if item_start && depth == 0 => {
                            item_start = false;
                            let name = ident(&group[k..]);
                            if !name.is_empty() {
                                found.push((name, line));
                            }
                        }
                        _ => {}
                    }
                }
            } else {
                let name = ident(after);
                if !name.is_empty() {
                    found.push((name, line));
                }
            }
        }
        offset += at + "crate::".len();
        rest = &code[offset..];
    }
    found
}

/// The crate's top-level module a source file belongs to (`src/http/proxy.rs`
/// and `src/http.rs` are in `http`), or `None` for the crate root.
fn module_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_owned())
}

/// The graph of the sources under `src` (test files left out).
fn graph_of(src: &Path) -> Graph {
    let mut graph = Graph::new();
    for (relative, code) in source::code_of(src) {
        let Some(from) = module_of(&relative) else {
            continue;
        };
        for (to, line) in crate_imports(&code) {
            if to != from {
                graph
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| format!("src/{}:{line}", relative.display()));
            }
        }
    }
    graph
}

/// What is wrong with `graph` under `page`, one line each.
fn violations(graph: &Graph, page: &Page) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut seen_known = BTreeSet::new();
    for (from, edges) in graph {
        let Some(&floor) = page.floors.get(from) else {
            wrong.push(format!("module {from} is on no floor of the page"));
            continue;
        };
        for (to, place) in edges {
            let Some(&below) = page.floors.get(to) else {
                wrong.push(format!("module {to} (imported at {place}) is on no floor"));
                continue;
            };
            if below < floor {
                continue;
            }
            if page.known.contains(&(from.clone(), to.clone())) {
                seen_known.insert((from.clone(), to.clone()));
                continue;
            }
            wrong.push(format!(
                "{from} (floor {floor}) imports {to} (floor {below}) at {place}: \
                 a module imports only from floors below its own"
            ));
        }
    }
    for (from, to) in page.known.difference(&seen_known) {
        wrong.push(format!(
            "the known violation {from} -> {to} no longer happens: strike it from the page"
        ));
    }
    // The cycles a known violation makes are known with it.
    let mut without_known = graph.clone();
    for (from, to) in &page.known {
        if let Some(edges) = without_known.get_mut(from) {
            edges.remove(to);
        }
    }
    if let Some(cycle) = a_cycle(&without_known) {
        wrong.push(format!("an import cycle: {}", cycle.join(" -> ")));
    }
    wrong
}

/// One cycle of the graph, if it has any (depth first, in name order).
fn a_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flat_map(|e| e.keys()) {
            if let Some(cycle) = visit(graph, next, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(graph, node, &mut Vec::new(), &mut done))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn page() -> Page {
        let path = root().join("../docs/architecture.md");
        let text = fs::read_to_string(&path).expect("docs/architecture.md");
        parse_page(&text).unwrap_or_else(|e| panic!("docs/architecture.md: {e}"))
    }

    /// The promise of the architecture page: every import between the
    /// crate's modules runs down its floors, no cycle.
    #[test]
    fn the_modules_import_only_down_the_architecture_pages_floors() {
        let graph = graph_of(&root().join("src"));
        let page = page();
        // Every module of the crate is drawn on the page.
        let lib = fs::read_to_string(root().join("src/lib.rs")).unwrap();
        for line in code_only(&lib).lines() {
            if let Some(name) = line.trim().strip_prefix("pub mod ") {
                let name = name.trim_end_matches(';');
                assert!(
                    page.floors.contains_key(name),
                    "module {name} is on no floor"
                );
            }
        }
        // The reading works: imports the crate is known to make are found.
        for (from, to) in [
            ("daemon", "engine"),
            ("http", "rules"),
            ("engine", "kernel"),
        ] {
            assert!(
                graph.get(from).is_some_and(|e| e.contains_key(to)),
                "{from} -> {to} not found: {graph:?}"
            );
        }
        let wrong = violations(&graph, &page);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// Inside each module, its own file and its children import one
    /// another without a cycle.
    #[test]
    fn no_module_and_its_children_import_in_a_cycle() {
        let graphs = inner::graphs_of(source::code_of(&root().join("src")));
        // The reading works: imports inside modules the crate is known to
        // make are found.
        for (module, from, to) in [
            ("kernel", "links", "netlink"),
            ("kernel", "datapath", "repin"),
            ("engine", "escalate", "(own file)"),
        ] {
            assert!(
                graphs
                    .get(module)
                    .and_then(|g| g.get(from))
                    .is_some_and(|e| e.contains_key(to)),
                "in {module}, {from} -> {to} not found: {:?}",
                graphs.get(module)
            );
        }
        let wrong = inner::cycles(&graphs);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// The check itself: a planted import up a floor, an import cycle, and
    /// a known violation that no longer happens each fail it; comments,
    /// strings and test code import nothing.
    #[test]
    fn a_planted_violation_fails_the_check() {
        let page = parse_page(
            "```floors\n2: daemon\n1: engine kernel\n0: clock\n```\n\
             ```known-violations\nkernel -> engine\n```\n",
        )
        .unwrap();
        let edge = |from: &str, to: &str| (from.to_owned(), to.to_owned());
        let graph_with = |edges: &[(String, String)]| {
            let mut graph = Graph::new();
            for (from, to) in edges {
                graph
                    .entry(from.clone())
                    .or_default()
                    .insert(to.clone(), "here".into());
            }
            graph
        };
        let fine = graph_with(&[
            edge("daemon", "engine"),
            edge("engine", "clock"),
            edge("kernel", "engine"),
        ]);
        assert_eq!(violations(&fine, &page), Vec::<String>::new());
        let up = graph_with(&[edge("kernel", "engine"), edge("clock", "daemon")]);
        assert!(violations(&up, &page)[0].contains("clock (floor 0) imports daemon"));
        let sideways = graph_with(&[edge("kernel", "engine"), edge("engine", "kernel")]);
        assert!(violations(&sideways, &page)[0].contains("engine (floor 1) imports kernel"));
        let circle = graph_with(&[
            edge("kernel", "engine"),
            edge("daemon", "engine"),
            edge("engine", "daemon"),
        ]);
        let wrong = violations(&circle, &page);
        assert!(
            wrong
                .iter()
                .any(|w| w.contains("engine (floor 1) imports daemon"))
        );
        assert!(
            wrong.contains(&"an import cycle: daemon -> engine -> daemon".to_owned()),
            "{wrong:?}"
        );
        let gone = graph_with(&[edge("daemon", "engine")]);
        assert!(violations(&gone, &page)[0].contains("kernel -> engine no longer happens"));

        let code = code_only(
            "use crate::{engine::GRACE, kernel::{maps, pins}};\n\
             // crate::daemon in a comment\n\
             let s = \"crate::daemon\"; let r = r#\"crate::daemon\"#; let c = '\"';\n\
             fn f<'a>(x: &'a crate::clock::Clock) {}\n",
        );
        let code = without_tests(&format!(
            "{code}#[cfg(test)]\nmod tests {{ use crate::daemon; }}\n"
        ));
        let names: Vec<(String, usize)> = crate_imports(&code);
        assert_eq!(
            names,
            [
                ("engine".to_owned(), 1),
                ("kernel".to_owned(), 1),
                ("clock".to_owned(), 4)
            ]
        );
    }
}
