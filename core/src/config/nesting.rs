//! How deep a rule file's YAML collections nest, found in one pass over the parser's events
//! before any tree is built: the tree, its drop and everything that walks it recurse once per
//! level, so a file nested past `MOST_YAML_DEPTH` is refused before it is built.

use yaml_rust2::parser::{Event, Parser};

use super::MOST_YAML_DEPTH;

/// The line where the file's first document nests collections deeper than `MOST_YAML_DEPTH`,
/// if it does. A file the parser cannot read is left for the loader to report.
pub(super) fn too_deep(text: &str) -> Option<usize> {
    let mut parser = Parser::new_from_str(text);
    let mut depth = 0usize;
    loop {
        let (event, mark) = parser.next_token().ok()?;
        match event {
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MOST_YAML_DEPTH {
                    return Some(mark.line());
                }
            }
            Event::SequenceEnd | Event::MappingEnd => depth = depth.saturating_sub(1),
            Event::DocumentEnd | Event::StreamEnd => return None,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping holding `levels - 1` sequences nested on its second line.
    fn nested(levels: usize) -> String {
        format!("a:\n  {}1\n", "- ".repeat(levels - 1))
    }

    #[test]
    fn nesting_past_the_cap_is_found_at_its_line_however_deep_it_goes() {
        assert_eq!(too_deep(&nested(MOST_YAML_DEPTH)), None);
        assert_eq!(too_deep(&nested(MOST_YAML_DEPTH + 1)), Some(2));
        assert_eq!(too_deep(&nested(1_000_000)), Some(2));
        assert_eq!(too_deep("a: [1, {b: [c]}]\nd: e\n"), None);
    }

    #[test]
    fn a_file_the_parser_cannot_read_is_left_to_the_loader() {
        assert_eq!(too_deep("a: [unclosed\n"), None);
    }
}
