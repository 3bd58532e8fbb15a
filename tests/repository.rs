//! The repository is all a user has: every document it names must be in it, and nothing may
//! point outside it.

use std::path::{Path, PathBuf};

/// Text files of the checkout (sources, docs, scripts), skipping build outputs and VCS data.
fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a checkout directory") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | "build" | "__pycache__")
                && !name.starts_with('.')
            {
                text_files(&path, out);
            }
        } else if [
            "rs", "md", "py", "h", "hpp", "c", "cpp", "hip", "toml", "txt", "sh", "in",
        ]
        .iter()
        .any(|ext| name.ends_with(&format!(".{ext}")))
            || name == "run"
        {
            out.push(path);
        }
    }
}

/// The upper-case document names (README and REFERENCE, each followed by ".md") of a text.
fn document_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in text.match_indices(".md") {
        let stem: String = text[..at]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let after = text[at + 3..].chars().next();
        if stem.len() >= 2 && !after.is_some_and(|c| c.is_ascii_alphanumeric()) {
            names.push(format!("{stem}.md"));
        }
    }
    names
}

#[test]
fn every_document_the_repository_names_is_in_it_and_nothing_points_outside() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    text_files(root, &mut files);
    let mut present = Vec::new();
    for file in &files {
        if let Some(name) = file.file_name().and_then(|n| n.to_str()) {
            present.push(name.to_string());
        }
    }
    assert!(files.len() > 50, "only {} text files found", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(file).display();
        for name in document_names(&text) {
            if !present.contains(&name) {
                problems.push(format!(
                    "{shown} names {name}, which is not in the repository"
                ));
            }
        }
        if text.contains(concat!("..", "/shared")) {
            problems.push(format!("{shown} points at a folder outside the repository"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Where a source file cites a numbered section, the section is REFERENCE.md's: the repository
/// ships no other numbered document, so a bare number (once the seventh section of a contract
/// users never see, for what REFERENCE.md numbers 11) sends a reader to the wrong place.
#[test]
fn every_section_a_source_file_cites_is_one_of_reference_md() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    text_files(root, &mut files);
    let mut problems = Vec::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e != "md"))
    {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(file).display();
        for word in ["section ", "sections ", "Section ", "Sections ", "§"] {
            for (at, _) in text.match_indices(word) {
                let rest = &text[at + word.len()..];
                if !rest.trim_start().starts_with(|c: char| c.is_ascii_digit())
                    || text[..at].ends_with(|c: char| c.is_ascii_alphanumeric())
                {
                    continue;
                }
                let from = text[..at]
                    .char_indices()
                    .rev()
                    .nth(59)
                    .map_or(0, |(i, _)| i);
                if !text[from..at].contains("REFERENCE") {
                    let line = text[..at].matches('\n').count() + 1;
                    let cited: String = rest.chars().take(12).collect();
                    problems.push(format!(
                        "{shown}:{line}: \"{word}{cited}\" names no document"
                    ));
                }
            }
        }
        if text.contains(concat!("CONTRACT", ".md")) || text.contains(concat!("CONTRACT", "'s")) {
            problems.push(format!(
                "{shown} cites a contract the repository does not ship"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
