//! The manual stays true to the code: every relative link in the README and the book
//! (`docs/`) reaches a file and, with an `#anchor`, one of its headings; every `anneal`
//! command in their shell blocks still parses (`ANNEAL_CHECK_ARGS=1` stops the binary right
//! after parsing its arguments). The book itself is built by `scripts/test.sh` (`mdbook`).

use anneal_tests::cli::{anneal, root};
use std::path::PathBuf;

/// The README and every page of the book.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// The anchor a heading gets (GitHub's and mdBook's rule: lower case, spaces to hyphens,
/// punctuation other than `-` and `_` dropped).
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every `](target)` of a Markdown text outside code, with its line.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let Some(end) = tail.find(')') else { break };
            out.push((i + 1, tail[..end].to_string()));
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn every_link_of_the_manual_reaches_its_file_and_heading() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = match path {
                "" => page.clone(),
                p => page.parent().unwrap().join(p),
            };
            let here = format!("{}:{line}: {target}", page.display());
            if !file.exists() {
                broken.push(format!("{here}: no such file"));
            } else if !anchor.is_empty() && file.extension().is_some_and(|e| e == "md") {
                let headings = anchors(&std::fs::read_to_string(&file).unwrap());
                if !headings.iter().any(|h| h == anchor) {
                    broken.push(format!("{here}: no heading #{anchor}"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Splits a shell command line into words (quotes removed), up to the first pipe, `&&`, `;`,
/// redirection or comment.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, '|' | ';' | '>' | '<' | '#' | '&') if !started || word.is_empty() => break,
            (None, c) if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    out
}

/// The `anneal` commands of a page's shell blocks: (line, arguments after `anneal`).
fn commands(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut shell = false;
    let mut pending = String::new();
    let mut start = 0;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(lang) = t.strip_prefix("```") {
            shell = !shell && matches!(lang.trim(), "sh" | "bash" | "shell" | "console");
            continue;
        }
        if !shell {
            continue;
        }
        if pending.is_empty() {
            start = i + 1;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head);
                pending.push(' ');
                continue;
            }
            None => pending.push_str(line),
        }
        let full = std::mem::take(&mut pending);
        // Commands built with substitutions or variables are not judged.
        if full.contains("$(") || full.contains('`') || full.contains("${") {
            continue;
        }
        let w = words(full.trim_start_matches("$ "));
        let Some(at) = w
            .iter()
            .position(|x| x == "anneal" || x.ends_with("/anneal"))
        else {
            continue;
        };
        // Environment assignments, `mpiexec -n N`, `time` may come first; nothing else.
        let lead_ok = w[..at].iter().all(|x| {
            x.contains('=')
                || x == "mpiexec"
                || x == "-n"
                || x.parse::<u32>().is_ok()
                || x == "time"
        });
        if lead_ok && !w[at + 1..].iter().any(|x| x.contains('$')) {
            out.push((start, w[at + 1..].to_vec()));
        }
    }
    out
}

#[test]
fn every_anneal_command_of_the_manual_parses() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (line, args) in commands(&text) {
            let out = anneal()
                .args(&args)
                .env("ANNEAL_CHECK_ARGS", "1")
                .output()
                .unwrap();
            checked += 1;
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                let first = err.lines().next().unwrap_or_default();
                bad.push(format!(
                    "{}:{line}: anneal {}\n    {first}",
                    page.display(),
                    args.join(" ")
                ));
            }
        }
    }
    assert!(checked >= 30, "only {checked} commands found");
    assert!(
        bad.is_empty(),
        "commands that no longer parse:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_readme_is_a_front_page() {
    let lines = std::fs::read_to_string(root().join("README.md"))
        .unwrap()
        .lines()
        .count();
    assert!(lines < 200, "README.md has {lines} lines");
    let summary = std::fs::read_to_string(root().join("docs/SUMMARY.md")).unwrap();
    for page in pages().iter().skip(1) {
        let name = page.file_name().unwrap().to_string_lossy();
        if name != "SUMMARY.md" {
            assert!(
                summary.contains(&format!("({name})")),
                "docs/SUMMARY.md lacks {name}"
            );
        }
    }
}
