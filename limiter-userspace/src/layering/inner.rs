//! Inside a module: its own file (`mod.rs`, a facade at best) and its
//! children, each child with everything under it, must import one another
//! without a cycle, as the modules of the crate must.
//!
//! Paths are read from `use` statements and from code: `crate::`,
//! `super::`, `self::` and the module's own children by name. Each is
//! taken down the crate's modules as far as they go, and a name a module
//! re-exports (`pub use child::Thing`) is followed to where it comes from:
//! a child that imports `super::Thing` uses the sibling that defines it.
//! A re-export itself is the facade's surface, no use of its own.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use super::{Graph, a_cycle};

/// A module by its path from the crate root (`http/proxy/relay.rs`:
/// `["http", "proxy", "relay"]`).
type ModPath = Vec<String>;

/// The module a file under `src` defines (`http/mod.rs`: `["http"]`).
fn module_path(relative: &Path) -> ModPath {
    let mut path: ModPath = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some(last) = path.last_mut()
        && let Some(stem) = last.strip_suffix(".rs")
    {
        *last = stem.to_owned();
    }
    if path.last().is_some_and(|l| l == "mod" || l == "lib") {
        path.pop();
    }
    path
}

/// A token of code: a word (identifier or keyword) or one of `::`, `{`,
/// `}`, `,`, `*`, `;`; anything else splits words.
#[derive(Clone, Debug, PartialEq)]
enum Token {
    Word(String),
    Sep(&'static str),
    Other,
}

/// The tokens of `code`, each with its line.
fn tokens(code: &str) -> Vec<(Token, usize)> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let (mut i, mut line) = (0, 1);
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((Token::Word(chars[start..i].iter().collect()), line));
            continue;
        }
        if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push((Token::Sep("::"), line));
            i += 2;
            continue;
        }
        match c {
            '{' => out.push((Token::Sep("{"), line)),
            '}' => out.push((Token::Sep("}"), line)),
            ',' => out.push((Token::Sep(","), line)),
            '*' => out.push((Token::Sep("*"), line)),
            ';' => out.push((Token::Sep(";"), line)),
            '\n' => line += 1,
            c if c.is_whitespace() => {}
            _ => out.push((Token::Other, line)),
        }
        i += 1;
    }
    out
}

fn word(token: Option<&(Token, usize)>) -> Option<&str> {
    match token {
        Some((Token::Word(w), _)) => Some(w),
        _ => None,
    }
}

fn is_sep(token: Option<&(Token, usize)>, sep: &str) -> bool {
    matches!(token, Some((Token::Sep(s), _)) if *s == sep)
}

/// The paths of one use tree from `tokens[i]`, each with the name it binds
/// (its last segment, or its `as` name; `*` for a glob); returns where the
/// tree ends.
fn use_tree(
    tokens: &[(Token, usize)],
    mut i: usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, String)>,
) -> usize {
    let mut path = prefix.to_vec();
    loop {
        if is_sep(tokens.get(i), "{") {
            i += 1;
            while i < tokens.len() && !is_sep(tokens.get(i), "}") {
                i = use_tree(tokens, i, &path, out);
                if is_sep(tokens.get(i), ",") {
                    i += 1;
                }
            }
            return i + 1;
        }
        if is_sep(tokens.get(i), "*") {
            out.push((path, "*".to_owned()));
            return i + 1;
        }
        let Some(segment) = word(tokens.get(i)) else {
            return i;
        };
        if segment != "self" {
            path.push(segment.to_owned());
        }
        i += 1;
        if is_sep(tokens.get(i), "::") {
            i += 1;
            continue;
        }
        let mut name = path.last().cloned().unwrap_or_default();
        if word(tokens.get(i)) == Some("as") {
            name = word(tokens.get(i + 1)).unwrap_or("_").to_owned();
            i += 2;
        }
        out.push((path, name));
        return i;
    }
}

/// What one file says: the paths it uses (each with its line) and the
/// names it re-exports (name -> path), its paths as written.
#[derive(Default)]
struct Said {
    uses: Vec<(Vec<String>, usize)>,
    reexports: BTreeMap<String, Vec<String>>,
    children: BTreeSet<String>,
}

/// Reads `code`'s use statements (`pub use` as re-exports), its `mod`
/// declarations and the other paths of its code.
fn read(code: &str) -> Said {
    let tokens = tokens(code);
    let mut said = Said::default();
    let mut i = 0;
    while i < tokens.len() {
        let at = |k: usize| word(tokens.get(k));
        if at(i) == Some("mod") && is_sep(tokens.get(i + 2), ";") {
            if let Some(name) = at(i + 1) {
                said.children.insert(name.to_owned());
            }
            i += 3;
            continue;
        }
        if at(i) == Some("use") {
            // `pub use` or `pub(crate) use`: a re-export.
            let public = at(i.wrapping_sub(1)) == Some("pub")
                || (i >= 4 && at(i - 4) == Some("pub") && matches!(tokens[i - 1].0, Token::Other));
            let line = tokens[i].1;
            let mut paths = Vec::new();
            i = use_tree(&tokens, i + 1, &[], &mut paths);
            for (path, name) in paths {
                if public && name != "*" {
                    said.reexports.insert(name, path);
                } else {
                    said.uses.push((path, line));
                }
            }
            continue;
        }
        let starts_path =
            is_sep(tokens.get(i + 1), "::") && !is_sep(tokens.get(i.wrapping_sub(1)), "::");
        if let (Some(first), true) = (at(i), starts_path) {
            let line = tokens[i].1;
            let mut path = vec![first.to_owned()];
            let mut k = i + 1;
            while is_sep(tokens.get(k), "::")
                && let Some(next) = at(k + 1)
            {
                path.push(next.to_owned());
                k += 2;
            }
            said.uses.push((path, line));
            i = k;
            continue;
        }
        i += 1;
    }
    said
}

/// The crate's modules and what each file says, by module.
struct Crate {
    files: BTreeMap<ModPath, (String, Said)>,
}

impl Crate {
    fn is_module(&self, path: &[String]) -> bool {
        self.files.contains_key(path)
    }

    /// A path as written in module `from`, from the crate root; `None`
    /// for a path outside the crate (`std::`, another crate, a local name).
    fn absolute(&self, from: &ModPath, path: &[String]) -> Option<ModPath> {
        let (first, rest) = path.split_first()?;
        match first.as_str() {
            "crate" => Some(rest.to_vec()),
            "self" => Some([from.as_slice(), rest].concat()),
            "super" => {
                let mut base = from.clone();
                let mut rest = path;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
                Some([base.as_slice(), rest].concat())
            }
            _ if self
                .files
                .get(from)
                .is_some_and(|(_, s)| s.children.contains(first)) =>
            {
                Some([from.as_slice(), path].concat())
            }
            _ => None,
        }
    }

    /// The module an absolute path names or names an item of, re-exports
    /// followed (a few steps at most: a cycle of re-exports ends there).
    fn target(&self, path: &[String]) -> ModPath {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let mut module: ModPath = Vec::new();
            while module.len() < path.len() && self.is_module(&path[..=module.len()]) {
                module.push(path[module.len()].clone());
            }
            let Some(item) = path.get(module.len()) else {
                return module;
            };
            let reexported = self
                .files
                .get(&module)
                .and_then(|(_, said)| said.reexports.get(item));
            match reexported.and_then(|to| self.absolute(&module, to)) {
                Some(from) => path = [from.as_slice(), &path[module.len() + 1..]].concat(),
                None => return module,
            }
        }
        path
    }
}

/// The node a module is in the graph of `scope`: its child under the
/// scope, or the scope's own file.
fn node(scope: &[String], module: &[String]) -> String {
    module
        .get(scope.len())
        .cloned()
        .unwrap_or_else(|| "(own file)".to_owned())
}

/// Each module's graph of its own file and its children (module ->
/// graph), from the code of the files under `src`.
pub fn graphs_of(files: Vec<(std::path::PathBuf, String)>) -> BTreeMap<String, Graph> {
    let krate = Crate {
        files: files
            .into_iter()
            .map(|(relative, code)| {
                (
                    module_path(&relative),
                    (format!("src/{}", relative.display()), read(&code)),
                )
            })
            .collect(),
    };
    let mut graphs: BTreeMap<String, Graph> = BTreeMap::new();
    for (from, (place, said)) in &krate.files {
        for (path, line) in &said.uses {
            let Some(absolute) = krate.absolute(from, path) else {
                continue;
            };
            let to = krate.target(&absolute);
            let scope: ModPath = from
                .iter()
                .zip(&to)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| a.clone())
                .collect();
            if scope.is_empty() || to == *from {
                // Between top-level modules: the floors' check.
                continue;
            }
            graphs
                .entry(scope.join("::"))
                .or_default()
                .entry(node(&scope, from))
                .or_default()
                .entry(node(&scope, &to))
                .or_insert_with(|| format!("{place}:{line}"));
        }
    }
    graphs
}

/// Each module whose own file and children import in a cycle, with one.
pub fn cycles(graphs: &BTreeMap<String, Graph>) -> Vec<String> {
    graphs
        .iter()
        .filter_map(|(module, graph)| {
            a_cycle(graph).map(|cycle| {
                let places: Vec<String> = cycle
                    .windows(2)
                    .map(|w| format!("{} -> {} at {}", w[0], w[1], graph[&w[0]][&w[1]]))
                    .collect();
                format!("in {module}: {}", places.join(", "))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn files(sources: &[(&str, &str)]) -> Vec<(PathBuf, String)> {
        sources
            .iter()
            .map(|(path, code)| (PathBuf::from(path), (*code).to_owned()))
            .collect()
    }

    #[test]
    fn use_trees_expand_to_paths_and_the_names_they_bind() {
        let mut out = Vec::new();
        let tokens = tokens("super::{keys::{self, Key as K}, Limiter, fleet::*}");
        use_tree(&tokens, 0, &[], &mut out);
        let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            out,
            vec![
                (s(&["super", "keys"]), "keys".to_owned()),
                (s(&["super", "keys", "Key"]), "K".to_owned()),
                (s(&["super", "Limiter"]), "Limiter".to_owned()),
                (s(&["super", "fleet"]), "*".to_owned()),
            ]
        );
    }

    /// A facade's children import one another through it: no cycle; a
    /// parent whose code uses a child that uses it: a cycle, named with
    /// its places.
    #[test]
    fn a_cycle_inside_a_module_is_found_through_its_re_exports() {
        let facade = files(&[
            (
                "http/mod.rs",
                "mod keys;\nmod limiter;\npub use limiter::Limiter;\npub use keys::Key;\n",
            ),
            ("http/keys.rs", "pub struct Key;\n"),
            (
                "http/limiter.rs",
                "use super::Key;\npub struct Limiter(Key);\n",
            ),
        ]);
        let graphs = graphs_of(facade);
        assert_eq!(graphs["http"]["limiter"]["keys"], "src/http/limiter.rs:1");
        assert_eq!(cycles(&graphs), Vec::<String>::new());

        let tangled = files(&[
            (
                "http/mod.rs",
                "mod keys;\npub struct Clock;\nfn f() { keys::hash(); }\n",
            ),
            (
                "http/keys.rs",
                "use crate::http::Clock;\npub fn hash() {}\n",
            ),
        ]);
        assert_eq!(
            cycles(&graphs_of(tangled)),
            vec![
                "in http: (own file) -> keys at src/http/mod.rs:3, \
                 keys -> (own file) at src/http/keys.rs:1"
                    .to_owned()
            ]
        );

        let siblings = files(&[
            ("kernel/mod.rs", "pub mod links;\npub mod netlink;\n"),
            (
                "kernel/links.rs",
                "use super::netlink::xdp_mode;\npub enum Mode {}\n",
            ),
            ("kernel/netlink.rs", "fn f(m: super::links::Mode) {}\n"),
        ]);
        assert_eq!(
            cycles(&graphs_of(siblings)),
            vec![
                "in kernel: links -> netlink at src/kernel/links.rs:1, \
                 netlink -> links at src/kernel/netlink.rs:1"
                    .to_owned()
            ]
        );
    }
}
