//! Every `mori-tp` command README.md and the docs/ book show works as written once the tool is
//! on PATH (`cargo install --path cli`), run from the repository root: each line of a
//! ```` ```sh runnable ```` block is a `mori-tp` command (or a comment) and must succeed, and each
//! `$ mori-tp ...` line of a ```` ```text ```` block must print exactly the lines shown under it.
//! A `mori-tp` command in a block not marked runnable is refused, so that none goes unchecked. A
//! file a command writes (`--svg FILE`) must be named outside the checkout (a reader's copy must
//! stay clean); the test writes it into its scratch folder instead.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root, where the documents' commands run.
fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ is inside the repository")
}

/// README.md and every page of docs/src, as (path, text).
fn documents() -> Vec<(String, String)> {
    fn pages(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("docs/src") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                pages(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![repository().join("README.md")];
    pages(&repository().join("docs/src"), &mut files);
    files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).expect("a document");
            let shown = file
                .strip_prefix(repository())
                .unwrap()
                .display()
                .to_string();
            (shown, text)
        })
        .collect()
}

/// A document's command line as arguments: the words after `mori-tp`, without a trailing
/// comment. A file the command writes (`--svg FILE`, an absolute path outside the checkout)
/// goes to the test's scratch folder instead.
fn arguments(line: &str) -> Vec<String> {
    let command = line.split(" #").next().unwrap();
    let mut words = command.split_whitespace();
    assert_eq!(words.next(), Some("mori-tp"), "{line}");
    let mut arguments: Vec<String> = words.map(String::from).collect();
    for i in 1..arguments.len() {
        if arguments[i - 1] == "--svg" && arguments[i] != "-" {
            let named = Path::new(&arguments[i]);
            assert!(
                named.is_absolute() && !named.starts_with(repository()),
                "`{line}` writes {} into the checkout: name a file outside it, such as \
                 /tmp/layout.svg",
                arguments[i]
            );
            let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme");
            std::fs::create_dir_all(&scratch).expect("scratch folder");
            let name = named.file_name().expect("a file name");
            arguments[i] = scratch.join(name).display().to_string();
        }
    }
    arguments
}

/// (where, command line, expected output if the document shows it) for every `mori-tp` command.
fn documented_commands() -> Vec<(String, String, Option<String>)> {
    let mut commands = Vec::new();
    for (document, text) in documents() {
        let mut block: Option<(String, bool)> = None;
        let mut lines = text.lines().enumerate().peekable();
        while let Some((number, line)) = lines.next() {
            let at = format!("{document}:{}", number + 1);
            if let Some(info) = line.strip_prefix("```") {
                block = match block {
                    Some(_) => None,
                    None => {
                        let mut words = info.split_whitespace();
                        let language = words.next().unwrap_or("").to_string();
                        Some((language, words.any(|w| w == "runnable")))
                    }
                };
                continue;
            }
            match &block {
                Some((language, true)) if language == "sh" => {
                    let t = line.trim();
                    if t.is_empty() || t.starts_with('#') {
                        continue;
                    }
                    assert!(
                        line.starts_with("mori-tp "),
                        "{at}: a `sh runnable` block holds only `mori-tp` commands: {line}"
                    );
                    commands.push((at, line.to_string(), None));
                }
                Some((language, false)) if language == "text" && line.starts_with("$ mori-tp ") => {
                    let mut shown = Vec::new();
                    while let Some((_, next)) = lines.peek() {
                        if next.starts_with("```") || next.starts_with("$ ") {
                            break;
                        }
                        shown.push(lines.next().unwrap().1);
                    }
                    commands.push((at, line[2..].to_string(), Some(shown.join("\n"))));
                }
                Some((_, false)) => assert!(
                    !line.trim_start().starts_with("mori-tp "),
                    "{at}: a `mori-tp` command in a block not marked runnable (```sh runnable): \
                     {line}"
                ),
                _ => {}
            }
        }
    }
    commands
}

#[test]
fn every_mori_tp_command_in_the_documents_works_as_written() {
    let commands = documented_commands();
    assert!(
        commands.len() >= 10,
        "the documents' `mori-tp` commands were not found: {commands:?}"
    );
    assert!(
        commands
            .iter()
            .any(|(at, _, _)| at.starts_with("README.md:")),
        "README.md must show a `mori-tp` command"
    );
    for (at, line, shown) in commands {
        let output = Command::new(env!("CARGO_BIN_EXE_mori-tp"))
            .args(arguments(&line))
            .current_dir(repository())
            .output()
            .expect("run mori-tp");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        match shown {
            None => assert!(
                output.status.success(),
                "{at}: `{line}` failed ({}):\n{printed}",
                output.status
            ),
            Some(shown) => assert_eq!(
                printed.trim_end(),
                shown.trim_end(),
                "{at}: `{line}` prints something else than the document shows"
            ),
        }
    }
}

#[test]
fn a_command_that_writes_into_the_checkout_is_refused() {
    let refused = std::panic::catch_unwind(|| arguments("mori-tp plan --svg l.svg"));
    assert!(refused.is_err(), "a relative --svg path must be refused");
    let moved = arguments("mori-tp plan --svg /tmp/layout.svg # a picture");
    assert!(
        moved[2].ends_with("readme/layout.svg") && !moved[2].starts_with("/tmp/"),
        "{moved:?}"
    );
    assert_eq!(arguments("mori-tp plan --svg -")[2], "-");
}
