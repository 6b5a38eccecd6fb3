//! Where each value of a YAML document stands, so that errors found after
//! deserializing (duplicates, overflow) can still name a line.

use std::collections::HashMap;

use yaml_rust2::{
    parser::{Event, MarkedEventReceiver, Parser},
    scanner::Marker,
};

/// Line (1-based) of every value in a document, by path: `rules[2].limit.rate`.
#[derive(Debug, Default)]
pub struct Locations(HashMap<String, usize>);

impl Locations {
    /// Indexes `text`; a document that does not even parse yields no
    /// locations (serde reports that error with its own position).
    pub fn index(text: &str) -> Self {
        let mut walker = Walker::default();
        let _ = Parser::new_from_str(text).load(&mut walker, false);
        Self(walker.lines)
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

enum Frame {
    Mapping { key: Option<String> },
    Sequence { index: usize },
}

#[derive(Default)]
struct Walker {
    stack: Vec<Frame>,
    lines: HashMap<String, usize>,
}

impl Walker {
    fn path(&self) -> String {
        let mut path = String::new();
        for frame in &self.stack {
            match frame {
                Frame::Mapping { key: Some(key) } => {
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push_str(key);
                }
                Frame::Mapping { key: None } => {}
                Frame::Sequence { index } => path.push_str(&format!("[{index}]")),
            }
        }
        path
    }

    /// A node starts at `mark`: either a mapping key or a value.
    fn node(&mut self, mark: Marker, scalar: Option<&str>) -> bool {
        if let Some(Frame::Mapping { key }) = self.stack.last_mut()
            && key.is_none()
        {
            *key = Some(scalar.unwrap_or_default().to_owned());
            let path = self.path();
            self.lines.entry(path).or_insert(mark.line());
            return true;
        }
        let path = self.path();
        self.lines.entry(path).or_insert(mark.line());
        false
    }

    /// A value is complete: the enclosing mapping awaits its next key, the
    /// enclosing sequence its next item.
    fn value_done(&mut self) {
        match self.stack.last_mut() {
            Some(Frame::Mapping { key }) => *key = None,
            Some(Frame::Sequence { index }) => *index += 1,
            None => {}
        }
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::Scalar(value, ..) => {
                let was_key = self.node(mark, Some(&value));
                if !was_key {
                    self.value_done();
                }
            }
            Event::Alias(_) => {
                self.node(mark, None);
                self.value_done();
            }
            Event::MappingStart(..) => {
                self.node(mark, None);
                self.stack.push(Frame::Mapping { key: None });
            }
            Event::SequenceStart(..) => {
                self.node(mark, None);
                self.stack.push(Frame::Sequence { index: 0 });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
                self.value_done();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_values() {
        let text = "default: pass\nrules:\n  - name: a\n    limit: { rate: 5, unit: second }\n  - name: b\n    match:\n      source: 10.0.0.0/8\n";
        let at = Locations::index(text);
        assert_eq!(at.line("default"), Some(1));
        assert_eq!(at.line("rules[0].name"), Some(3));
        assert_eq!(at.line("rules[0].limit.unit"), Some(4));
        assert_eq!(at.line("rules[1]"), Some(5));
        assert_eq!(at.line("rules[1].match.source"), Some(7));
        assert_eq!(at.line("rules[1].key"), Some(5));
    }
}
