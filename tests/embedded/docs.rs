//! The manual holds together: every relative link of the repository's Markdown (README.md, docs/,
//! BENCHMARKS.md, deploy/, examples/…) reaches a file, and every `#anchor` a heading of its page,
//! slugged as GitHub slugs it; and every flag `sluice serve --help` lists is documented in docs/.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `serve --help` lists these, which are not `serve`'s own.
const NOT_SERVE_FLAGS: [&str; 2] = ["--help", "--version"];

/// Every Markdown file of the repository, relative to its root; build output and hidden
/// directories left out.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let name = path.file_name().unwrap().to_string_lossy();
            if name.starts_with('.') || (dir == Path::new(ROOT) && name == "target") {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else if name.ends_with(".md") {
                out.push(path.strip_prefix(ROOT).unwrap().to_path_buf());
            }
        }
    }
    let mut files = Vec::new();
    walk(Path::new(ROOT), &mut files);
    files
}

/// One parsed Markdown file: its headings' anchors and its links, with their lines.
struct Page {
    anchors: BTreeSet<String>,
    links: Vec<(usize, String)>,
}

/// Whether `line` opens or closes a fenced code block, whose lines are neither headings nor
/// links.
fn is_fence(line: &str) -> bool {
    let trimmed = line.trim_start();
    line.len() - trimmed.len() < 4 && (trimmed.starts_with("```") || trimmed.starts_with("~~~"))
}

/// `line` without its inline code spans: a link's text may hold one, but what a code span holds
/// is never a link.
fn without_code_spans(line: &str) -> String {
    let parts: Vec<&str> = line.split('`').collect();
    // Odd parts are code, but for the last after a backtick that nothing closes.
    let unclosed = parts.len().is_multiple_of(2);
    parts
        .iter()
        .enumerate()
        .filter(|(i, _)| i.is_multiple_of(2) || (unclosed && *i == parts.len() - 1))
        .map(|(_, part)| *part)
        .collect()
}

/// The anchor GitHub gives a heading: its text as rendered (links as their text, code without
/// backticks), lowercased, every space a `-`, and every character but letters, digits, `-` and
/// `_` dropped.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..].find("](").and_then(|close| {
            let after = open + close + 2;
            rest[after..]
                .find(')')
                .map(|end| (open + close, after + end))
        }) {
            Some((close, end)) => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..close]);
                rest = &rest[end + 1..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn parse(text: &str) -> Page {
    let mut anchors = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut links = Vec::new();
    let mut in_code = false;
    for (n, line) in text.lines().enumerate() {
        if is_fence(line) {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let hashes = line.len() - line.trim_start_matches('#').len();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let heading = line[hashes..].trim().trim_end_matches('#').trim_end();
            let base = slug(heading);
            let count = seen.entry(base.clone()).or_insert(0);
            anchors.insert(match *count {
                0 => base,
                k => format!("{base}-{k}"),
            });
            *count += 1;
        }
        let plain = without_code_spans(line);
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            links.push((n + 1, target.to_owned()));
            rest = &rest[end..];
        }
    }
    Page { anchors, links }
}

/// What is wrong with `target`, linked from `file`, if anything.
fn broken(file: &Path, target: &str, pages: &BTreeMap<PathBuf, Page>) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link".into());
    }
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let linked = if path.is_empty() {
        file.to_path_buf()
    } else {
        match normalize(&file.parent().unwrap_or(Path::new("")).join(path)) {
            Some(linked) => linked,
            None => return Some("leaves the repository".into()),
        }
    };
    if !Path::new(ROOT).join(&linked).exists() {
        return Some(format!("no such file: {}", linked.display()));
    }
    let anchor = anchor?;
    let page = pages.get(&linked)?;
    (!page.anchors.contains(anchor)).then(|| {
        format!(
            "no heading of {} has the anchor #{anchor}",
            linked.display()
        )
    })
}

/// `path` with its `.` and `..` steps resolved; `None` when it leaves the repository.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            other => out.push(other),
        }
    }
    Some(out)
}

#[test]
fn headings_are_slugged_as_github_slugs_them() {
    let page = parse(
        "# Quota service (RLQS)\n## Running as `ratelimit`\n```\n# not a heading\n```\n\
         ### Counting: charges after the response\n## Metrics\n## Metrics\n## Metrics\n\
         ## Through Envoy: no limiter, RLS, RLQS\n## [Linked](elsewhere.md) heading\n",
    );
    let expected = [
        "quota-service-rlqs",
        "running-as-ratelimit",
        "counting-charges-after-the-response",
        "metrics",
        "metrics-1",
        "metrics-2",
        "through-envoy-no-limiter-rls-rlqs",
        "linked-heading",
    ];
    assert_eq!(
        page.anchors,
        expected
            .iter()
            .map(|a| a.to_string())
            .collect::<BTreeSet<_>>()
    );
}

#[test]
fn links_are_found_outside_code_only() {
    let page = parse(
        "[a](a.md) and [`b`](b.md#x), `[c](c.md)`\n```\n[d](d.md)\n```\n[e\nf](e.md \"title\")\n",
    );
    let targets: Vec<&str> = page.links.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(targets, ["a.md", "b.md#x", "e.md"]);
}

#[test]
fn every_relative_link_and_anchor_of_the_manual_resolves() {
    let files = markdown_files();
    assert!(
        files.contains(&PathBuf::from("README.md")) && files.iter().any(|f| f.starts_with("docs")),
        "the manual is not where this test looks: {files:?}"
    );
    let pages: BTreeMap<PathBuf, Page> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(Path::new(ROOT).join(f)).unwrap();
            (f.clone(), parse(&text))
        })
        .collect();
    let mut problems = Vec::new();
    for (file, page) in &pages {
        for (line, target) in &page.links {
            if let Some(why) = broken(file, target, &pages) {
                problems.push(format!("{}:{line}: ({target}): {why}", file.display()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_serve_flag_is_documented_in_docs() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--help"])
        .output()
        .expect("sluice runs");
    assert!(out.status.success(), "sluice serve --help failed");
    let help = String::from_utf8(out.stdout).expect("UTF-8 help");
    // Options start their line (indented at most six columns); their descriptions, indented
    // further, may name other flags.
    let flags: BTreeSet<String> = help
        .lines()
        .filter(|l| l.trim_start().starts_with('-') && l.len() - l.trim_start().len() <= 6)
        .flat_map(|l| {
            l.split([' ', ',', '='])
                .filter(|w| w.starts_with("--") && w.len() > 2)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter(|f| !NOT_SERVE_FLAGS.contains(&f.as_str()))
        .collect();
    assert!(
        flags.len() > 40,
        "too few flags read from the help: {flags:?}"
    );
    let docs: String = markdown_files()
        .iter()
        .filter(|f| f.starts_with("docs"))
        .map(|f| std::fs::read_to_string(Path::new(ROOT).join(f)).unwrap())
        .collect();
    let documented = |flag: &str| {
        let quoted = format!("`{flag}");
        docs.match_indices(&quoted).any(|(at, _)| {
            docs[at + quoted.len()..]
                .chars()
                .next()
                .is_some_and(|c| !(c.is_ascii_alphanumeric() || c == '-'))
        })
    };
    let missing: Vec<&String> = flags.iter().filter(|f| !documented(f)).collect();
    assert!(
        missing.is_empty(),
        "{} serve flag(s) not documented as `--flag` in docs/:\n{}",
        missing.len(),
        missing
            .iter()
            .map(|f| f.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The `sh` blocks of `page` under the heading `heading` (up to the next heading of any level).
fn sh_blocks(page: &str, heading: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(ROOT).join(page)).unwrap();
    let mut blocks = Vec::new();
    let (mut inside, mut block): (bool, Option<String>) = (false, None);
    for line in text.lines() {
        match &mut block {
            Some(lines) if is_fence(line) => {
                blocks.push(std::mem::take(lines));
                block = None;
            }
            Some(lines) => {
                lines.push_str(line);
                lines.push('\n');
            }
            None if line.starts_with('#') => {
                inside = line.trim_start_matches('#').trim() == heading
            }
            None if inside && line.trim_start() == "```sh" => block = Some(String::new()),
            None => {}
        }
    }
    blocks
}

/// The admin snippets of docs/operating.md (Authentication, Counters by hand) run as written,
/// in a shell with a home of its own and the built `sluice` first on its path, from the
/// repository's root: they make a token, start a server with it, and ask it. The server each
/// starts (on the default ports 8080 and 8081) is stopped when its block ends.
#[test]
fn the_admin_snippets_of_the_operating_manual_run_as_written() {
    let home = tempfile::tempdir().unwrap();
    let binary = Path::new(env!("CARGO_BIN_EXE_sluice"));
    let path = format!(
        "{}:{}",
        binary.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for heading in ["Authentication", "Counters by hand"] {
        for block in sh_blocks("docs/operating.md", heading)
            .into_iter()
            .filter(|b| b.contains("sluice serve"))
        {
            let script = format!(
                "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n{block}"
            );
            let out = Command::new("bash")
                .args(["-c", &script])
                .current_dir(ROOT)
                .env("HOME", home.path())
                .env("PATH", &path)
                .env_remove("SLUICE_ADMIN_TOKEN_FILE")
                .env_remove("SLUICE_HTTP_ADDR")
                .env_remove("SLUICE_GRPC_ADDR")
                .output()
                .expect("bash runs");
            assert!(
                out.status.success(),
                "{heading}: the snippet fails:\n{block}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                !out.stdout.is_empty(),
                "{heading}: the snippet printed nothing"
            );
            ran += 1;
        }
    }
    assert_eq!(ran, 2, "one snippet under each heading");
}
