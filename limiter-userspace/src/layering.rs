//! The layering of `docs/architecture.md`, held by a test: the imports
//! between the crate's top-level modules are read from the sources (every
//! `crate::` path outside comments, strings and test code) and each must
//! run down the page's floors; any that does not, and any cycle, fails.
//! Imports the page lists as known violations are let through until they
//! are gone, and the list may only shrink: one that no longer happens
//! fails too.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

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

/// The source without comments, string and char literals (their contents
/// become spaces; lines are kept, for the places reported).
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && matches!(next, Some('"' | '#'))
            && !chars
                .get(i.wrapping_sub(1))
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            let closing: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            while j < chars.len() && !chars[j..].starts_with(&closing) {
                out.push(blank(chars[j]));
                j += 1;
            }
            i = j + closing.len();
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if let Some(&c) = chars.get(i) {
                    out.push(blank(c));
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\u{..}'); otherwise a lifetime.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The code without its test code: each `#[cfg(test)]` item (a module or
/// a function, to its closing brace or semicolon) is blanked.
fn without_tests(code: &str) -> String {
    let mut out: Vec<char> = code.chars().collect();
    let marker: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + marker.len() <= out.len() {
        if out[i..i + marker.len()] != marker[..] {
            i += 1;
            continue;
        }
        let start = i;
        let mut j = i + marker.len();
        let mut depth = 0;
        while j < out.len() {
            match out[j] {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                ';' if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        let end = (j + 1).min(out.len());
        for c in &mut out[start..end] {
            if *c != '\n' {
                *c = ' ';
            }
        }
        i = j + 1;
    }
    out.into_iter().collect()
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

/// The graph of the sources under `src` (test files, `tests.rs`, left out).
fn graph_of(src: &Path) -> Graph {
    let mut graph = Graph::new();
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("the crate's sources") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                files.push(path);
            }
        }
    }
    files.sort();
    for path in files {
        let relative = path.strip_prefix(src).expect("under src");
        let Some(from) = module_of(relative) else {
            continue;
        };
        let source = fs::read_to_string(&path).expect("a source file");
        let code = without_tests(&code_only(&source));
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
