//! `strftime_now(format)` for chat templates, as `transformers` defines it
//! (`datetime.now().strftime(format)`): the directives templates use, on
//! the current UTC time (a server's local time is usually UTC; no time
//! zone database is read).

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A moment, broken down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Civil {
    year: i64,
    /// 1-12.
    month: u32,
    /// 1-31.
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-366.
    yday: u32,
}

/// Seconds since the Unix epoch as a UTC date and time (Howard Hinnant's
/// `civil_from_days`).
fn civil(secs: i64) -> Civil {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = BEFORE[(month - 1) as usize] + day + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        hour: (rem / 3600) as u32,
        minute: (rem % 3600 / 60) as u32,
        second: (rem % 60) as u32,
        // 1970-01-01 was a Thursday.
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

/// `format` with the time `c`: `%Y %y %m %d %e %H %M %S %B %b %A %a %j %%`
/// (and glibc's `%-d`, `%-m`, `%-H` without padding); other directives are
/// copied as written.
fn format(format: &str, c: Civil) -> String {
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        let (unpadded, spec) = match chars.next() {
            Some('-') => (true, chars.next()),
            other => (false, other),
        };
        let num = |v: u32, width: usize| {
            if unpadded {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match spec {
            Some('Y') => out.push_str(&c.year.to_string()),
            Some('y') => out.push_str(&num(c.year.rem_euclid(100) as u32, 2)),
            Some('m') => out.push_str(&num(c.month, 2)),
            Some('d') => out.push_str(&num(c.day, 2)),
            Some('e') => out.push_str(&format!("{:>2}", c.day)),
            Some('H') => out.push_str(&num(c.hour, 2)),
            Some('M') => out.push_str(&num(c.minute, 2)),
            Some('S') => out.push_str(&num(c.second, 2)),
            Some('j') => out.push_str(&num(c.yday, 3)),
            Some('B') => out.push_str(MONTHS[(c.month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(c.month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[c.weekday as usize]),
            Some('a') => out.push_str(&DAYS[c.weekday as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The current UTC time in `fmt`.
pub fn format_now(fmt: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format(fmt, civil(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates_as_python_does() {
        // 2024-02-29 13:05:09 UTC, a Thursday (day 60 of a leap year).
        let c = civil(1_709_211_909);
        assert_eq!(format("%Y-%m-%d %H:%M:%S", c), "2024-02-29 13:05:09");
        assert_eq!(format("%d %b %Y", c), "29 Feb 2024");
        assert_eq!(
            format("%A, %B %-d, %y (%j) %a %%", c),
            "Thursday, February 29, 24 (060) Thu %"
        );
        assert_eq!(format("%e|%-m|%Q", civil(0)), " 1|1|%Q");
        assert_eq!(format("%Y-%m-%d %A", civil(0)), "1970-01-01 Thursday");
        // Before the epoch, and the last day of a year.
        assert_eq!(format("%Y-%m-%d %j", civil(-86_400)), "1969-12-31 365");
        assert_eq!(
            format("%Y-%m-%d %j", civil(1_735_603_200)),
            "2024-12-31 366"
        );
    }
}
