//! Every `mori-tp` command the README shows works as written once the tool is on PATH
//! (`cargo install --path cli`), run from the repository root: each line of a ```sh block that
//! starts with `mori-tp` must succeed, and each `$ mori-tp ...` line of a ```text block must print
//! exactly the lines shown under it.

use std::path::Path;
use std::process::Command;

/// The workspace root, where the README's commands run.
fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ is inside the repository")
}

/// A README command line as arguments: the words after `mori-tp`, without a trailing comment.
/// A file the command writes (`--svg FILE`) goes to the test's scratch folder instead of the
/// checkout.
fn arguments(line: &str) -> Vec<String> {
    let command = line.split(" #").next().unwrap();
    let mut words = command.split_whitespace();
    assert_eq!(words.next(), Some("mori-tp"), "{line}");
    let mut arguments: Vec<String> = words.map(String::from).collect();
    for i in 1..arguments.len() {
        if arguments[i - 1] == "--svg" {
            let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme");
            std::fs::create_dir_all(&scratch).expect("scratch folder");
            arguments[i] = scratch.join(&arguments[i]).display().to_string();
        }
    }
    arguments
}

/// (command line, expected output if the README shows it) for every `mori-tp` command.
fn readme_commands() -> Vec<(String, Option<String>)> {
    let readme = std::fs::read_to_string(repository().join("README.md")).expect("README.md");
    let mut commands = Vec::new();
    let mut block: Option<&str> = None;
    let mut lines = readme.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(fence) = line.strip_prefix("```") {
            block = if block.is_some() { None } else { Some(fence) };
            continue;
        }
        match block {
            Some("sh") if line.starts_with("mori-tp ") => commands.push((line.to_string(), None)),
            Some("text") if line.starts_with("$ mori-tp ") => {
                let mut shown = Vec::new();
                while let Some(next) = lines.peek() {
                    if next.starts_with("```") || next.starts_with("$ ") {
                        break;
                    }
                    shown.push(lines.next().unwrap());
                }
                commands.push((line[2..].to_string(), Some(shown.join("\n"))));
            }
            _ => {}
        }
    }
    commands
}

#[test]
fn every_mori_tp_command_in_the_readme_works_as_written() {
    let commands = readme_commands();
    assert!(
        commands.len() >= 5,
        "the README's `mori-tp` commands were not found: {commands:?}"
    );
    for (line, shown) in commands {
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
                "`{line}` failed ({}):\n{printed}",
                output.status
            ),
            Some(shown) => assert_eq!(
                printed.trim_end(),
                shown.trim_end(),
                "`{line}` prints something else than the README shows"
            ),
        }
    }
}
