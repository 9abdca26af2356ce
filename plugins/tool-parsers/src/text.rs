//! Small string helpers shared by the formats (byte offsets, always on char
//! boundaries).

/// The offset of the first non-whitespace char at or after `i`.
pub fn skip_ws(s: &str, i: usize) -> usize {
    match s.get(i..) {
        Some(rest) => i + (rest.len() - rest.trim_start().len()),
        None => s.len(),
    }
}

/// The offset of `pat` at or after `from`.
pub fn find(s: &str, from: usize, pat: &str) -> Option<usize> {
    s.get(from..)?.find(pat).map(|i| i + from)
}

/// The earliest of `pats` at or after `from`: (offset, which).
pub fn find_any(s: &str, from: usize, pats: &[&str]) -> Option<(usize, usize)> {
    pats.iter()
        .enumerate()
        .filter_map(|(k, p)| find(s, from, p).map(|at| (at, k)))
        .min()
}

/// Whether `rest` (possibly empty) could still grow into `pat`.
pub fn could_become(rest: &str, pat: &str) -> bool {
    rest.len() < pat.len() && pat.starts_with(rest)
}

/// Where the text must be held back because its end could be the start of
/// one of `pats`: the earliest offset at or after `from` whose suffix is a
/// proper prefix of a pattern, else `s.len()`. Call it only when no pattern
/// occurs whole in `s[from..]`.
pub fn held_from(s: &str, from: usize, pats: &[&str]) -> usize {
    let longest = pats.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut start = s.len().saturating_sub(longest).max(from);
    while start < s.len() {
        if s.is_char_boundary(start) {
            let rest = &s[start..];
            if pats.iter().any(|p| could_become(rest, p)) {
                return start;
            }
        }
        start += 1;
    }
    s.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_a_marker_prefix() {
        assert_eq!(held_from("ab<tool_", 0, &["<tool_call>"]), 2);
        assert_eq!(held_from("ab<", 0, &["<tool_call>"]), 2);
        assert_eq!(held_from("ab<x", 0, &["<tool_call>"]), 4);
        assert_eq!(held_from("é<", 0, &["<a>"]), 2);
        assert_eq!(held_from("<", 1, &["<a>"]), 1);
    }

    #[test]
    fn finds_the_earliest() {
        assert_eq!(find_any("xx<b><a>", 0, &["<a>", "<b>"]), Some((2, 1)));
        assert_eq!(find_any("xx", 5, &["<a>"]), None);
        assert_eq!(skip_ws("  a", 0), 2);
        assert_eq!(skip_ws("  ", 0), 2);
    }
}
