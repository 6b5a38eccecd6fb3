//! No source file of the crate (its integration tests too) over
//! [`MAX_LINES`]: a file that grows past
//! it has taken on a second job (issue 37 split the last ones).

/// Lines a source file may have.
const MAX_LINES: usize = 600;

#[cfg(test)]
mod tests {
    use std::{fs, path::PathBuf};

    use super::MAX_LINES;
    use crate::layering::source::rust_files;

    /// The crate's sources and its integration tests.
    #[test]
    fn no_source_file_is_over_600_lines() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let files: Vec<PathBuf> = ["src", "tests"]
            .iter()
            .flat_map(|dir| rust_files(&root.join(dir)))
            .collect();
        assert!(
            files.len() > 50,
            "{} files: the walk is broken",
            files.len()
        );
        let long: Vec<String> = files
            .iter()
            .filter_map(|path| {
                let lines = fs::read_to_string(path)
                    .expect("a source file")
                    .lines()
                    .count();
                (lines > MAX_LINES).then(|| format!("{} has {lines} lines", path.display()))
            })
            .collect();
        assert!(
            long.is_empty(),
            "over {MAX_LINES} lines, each file one job:\n{}",
            long.join("\n")
        );
    }
}
