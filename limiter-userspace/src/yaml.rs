//! Reading YAML files (the rule file, the daemon's configuration, envoy's
//! configuration for the import) into serde types, with every error naming
//! the file, the line and the field:
//! `rules.yaml:3: rules[0].limit: unknown field `brust``. serde-saphyr
//! parses (with limits on depth, aliases and size) and gives locations;
//! serde_path_to_error gives the field path; [`Lines`] gives the line of any
//! field for errors found after deserializing (duplicates, overflow).

use std::{
    collections::HashMap,
    fmt,
    path::{Path, PathBuf},
};

use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned, MapAccess, SeqAccess, Visitor},
};
use serde_saphyr::{MergeKeyPolicy, MessageFormatter, Spanned};

/// A file that was rejected, and where.
#[derive(Debug, thiserror::Error)]
pub struct InvalidFile {
    pub file: PathBuf,
    pub line: Option<usize>,
    /// The field, e.g. `rules[2].limit.rate`; empty for the whole file.
    pub field: String,
    pub message: String,
}

impl fmt::Display for InvalidFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The most of a rejected value an error shows: enough to find it, not
/// enough for a 10 MB value to flood a terminal, a log or a socket.
const SHOWN: usize = 64;

/// `text` quoted for an error message, cut after [`SHOWN`] bytes (at a
/// character boundary) with how much was left out.
pub fn quoted(text: &str) -> String {
    if text.len() <= SHOWN {
        return format!("{text:?}");
    }
    let cut = (0..=SHOWN)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    format!("{:?}… ({} bytes)", &text[..cut], text.len())
}

/// A message cut to a few lines' length: the parser's own messages may
/// quote a value whole (`unknown variant `...``).
fn bounded(message: String) -> String {
    const MAX: usize = 4 * SHOWN;
    if message.len() <= MAX {
        return message;
    }
    let cut = (0..=MAX)
        .rev()
        .find(|&i| message.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}… ({} bytes)", &message[..cut], message.len())
}

/// The largest file read, checked before parsing (the control socket's
/// own line limit): a rule file of 10,000 rules is about 1 MiB.
pub const MAX_INPUT: usize = 4 << 20;

/// The deepest nesting of mappings and sequences parsed: a rule file needs
/// 4 levels, an envoy configuration a few per nested descriptor.
const MAX_DEPTH: usize = 32;

/// How YAML is read: plain errors (no source snippet), YAML 1.2 booleans
/// only (`on` and `no` are strings), no `<<` merge keys (a rule file says
/// what it means where it says it), and bounded work: depth, nodes and
/// aliases capped as the parser reads (serde-saphyr's budget, its
/// defaults but for the depth), so no input makes it run long or grow.
fn options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_DEPTH;
    serde_saphyr::options! {
        with_snippet: false,
        strict_booleans: true,
        merge_keys: MergeKeyPolicy::Error,
        budget: Some(budget),
    }
}

fn too_large(origin: &Path, bytes: u64) -> InvalidFile {
    InvalidFile {
        file: origin.to_owned(),
        line: None,
        field: String::new(),
        message: format!(
            "{bytes} bytes; a file is read only up to {} MiB",
            MAX_INPUT >> 20
        ),
    }
}

/// Reads a YAML file into `T`, with the file, line and field in errors.
pub fn load<T: DeserializeOwned>(path: &Path) -> Result<T, InvalidFile> {
    parse(&read(path)?, path)
}

/// Reads a file of at most [`MAX_INPUT`] bytes (a larger one is not read).
pub fn read(path: &Path) -> Result<String, InvalidFile> {
    use std::io::Read;
    let unreadable = |e: std::io::Error| InvalidFile {
        file: path.to_owned(),
        line: None,
        field: String::new(),
        message: format!("cannot read: {e}"),
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let mut text = String::new();
    file.take(MAX_INPUT as u64 + 1)
        .read_to_string(&mut text)
        .map_err(unreadable)?;
    if text.len() > MAX_INPUT {
        let size = std::fs::metadata(path).map_or(text.len() as u64, |m| m.len());
        return Err(too_large(path, size));
    }
    Ok(text)
}

/// Deserializes YAML text; `origin` names it in errors.
pub fn parse<T: DeserializeOwned>(text: &str, origin: &Path) -> Result<T, InvalidFile> {
    if text.len() > MAX_INPUT {
        return Err(too_large(origin, text.len() as u64));
    }
    let mut track = serde_path_to_error::Track::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(text, options(), |de| {
        T::deserialize(serde_path_to_error::Deserializer::new(de, &mut track))
    });
    result.map_err(|error| {
        let mut path = field_path(&track.path());
        // The path of an unknown field ends in the unknown key itself; the
        // field at fault is the mapping that does not have it.
        if matches!(
            error.without_snippet(),
            serde_saphyr::Error::SerdeUnknownField { .. }
        ) {
            path.truncate(path.rfind(['.', '[']).unwrap_or(0));
        }
        InvalidFile {
            file: origin.to_owned(),
            line: error
                .location()
                .map(|l| l.line() as usize)
                .filter(|&l| l > 0),
            field: path,
            message: bounded(
                serde_saphyr::DefaultMessageFormatter
                    .format_message(&error)
                    .into_owned(),
            ),
        }
    })
}

/// `rules[2].limit.rate`, as serde_path_to_error tracked it; empty for
/// the document itself.
fn field_path(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            serde_path_to_error::Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            serde_path_to_error::Segment::Enum { variant } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(variant);
            }
            serde_path_to_error::Segment::Unknown => {}
        }
    }
    out
}

/// The line of every field of a document, by path (`rules[1].match`).
#[derive(Debug, Default)]
pub struct Lines(HashMap<String, usize>);

impl Lines {
    /// Indexes `text`; a document that does not parse yields no lines
    /// (its error was reported with its own line already).
    pub fn index(text: &str) -> Self {
        let mut lines = HashMap::new();
        if let Ok(root) = serde_saphyr::from_str_with_options::<Node>(text, options()) {
            root.record("", &mut lines);
        }
        Self(lines)
    }

    /// The line of `path`, or of its nearest ancestor that has one.
    pub fn line(&self, path: &str) -> Option<usize> {
        let mut path = path;
        loop {
            if let Some(line) = self.0.get(path) {
                return Some(*line);
            }
            path = &path[..path.rfind(['.', '['])?];
        }
    }
}

/// Any YAML value; a mapping's fields with the location of their key (a
/// block value starts on the line after it), a sequence's items with their
/// own.
enum Node {
    Map(Vec<(Spanned<Key>, Node)>),
    Seq(Vec<Spanned<Node>>),
    Scalar,
}

impl Node {
    fn record(&self, path: &str, lines: &mut HashMap<String, usize>) {
        match self {
            Self::Map(entries) => {
                for (key, node) in entries {
                    let path = if path.is_empty() {
                        key.value.0.clone()
                    } else {
                        format!("{path}.{}", key.value.0)
                    };
                    lines.insert(path.clone(), key.referenced.line() as usize);
                    node.record(&path, lines);
                }
            }
            Self::Seq(items) => {
                for (i, node) in items.iter().enumerate() {
                    let path = format!("{path}[{i}]");
                    lines.insert(path.clone(), node.referenced.line() as usize);
                    node.value.record(&path, lines);
                }
            }
            Self::Scalar => {}
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NodeVisitor;
        impl<'de> Visitor<'de> for NodeVisitor {
            type Value = Node;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<Spanned<Key>>()? {
                    entries.push((key, map.next_value()?));
                }
                Ok(Node::Map(entries))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Node::Seq(items))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_i128<E: de::Error>(self, _: i128) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_u128<E: de::Error>(self, _: u128) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_none<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
                Node::deserialize(d)
            }
        }
        deserializer.deserialize_any(NodeVisitor)
    }
}

/// A mapping key as text, whatever its YAML type (`53:` is a number).
struct Key(String);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a scalar key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key(v.to_owned()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Key, E> {
                Ok(Key(v.to_string()))
            }
        }
        deserializer.deserialize_any(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::{Lines, quoted};

    #[test]
    fn long_values_are_cut_in_errors() {
        assert_eq!(quoted("10.0.0.0/33"), "\"10.0.0.0/33\"");
        let long = "é".repeat(5_000_000);
        let shown = quoted(&long);
        assert!(
            shown.len() < 100 && shown.ends_with("… (10000000 bytes)"),
            "{shown}"
        );
    }

    /// Guards the lines of fields found after parsing: a field's line is
    /// its key's, also when its value is a block starting on the next line.
    #[test]
    fn fields_are_found_on_their_keys_line() {
        let lines = Lines::index(
            "rules:\n  - name: a\n    match:\n      source: 10.0.0.0/8\n    limit: { rate: 1, unit: second }\n  - { name: b, limit: unlimited }\n",
        );
        for (path, line) in [
            ("rules", 1),
            ("rules[0]", 2),
            ("rules[0].name", 2),
            ("rules[0].match", 3),
            ("rules[0].match.source", 4),
            ("rules[0].limit.unit", 5),
            ("rules[1].limit", 6),
            // A field that is not there: its nearest ancestor's line.
            ("rules[1].limit.rate", 6),
        ] {
            assert_eq!(lines.line(path), Some(line), "{path}");
        }
    }
}
