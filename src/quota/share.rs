//! Max-min fair division of a bucket's limit among the streams that report it, as Doorman's
//! FAIR_SHARE divides capacity among clients: no stream gets more than it asks while another that
//! asks more gets less than an equal part. What nobody asks for is spread evenly on top, so that a
//! stream whose demand grows is not held at its last demand until its next report.

use super::MILLI;

/// Divides `limit` whole requests per window among streams asking `demands` (thousandths of a
/// request per window, in stream order). The shares are whole requests and add up to `limit`
/// exactly; when there are at least as many requests as streams, every stream gets one at least,
/// so that none is shut out before its demand is known. Deterministic: every replica divides the
/// same demands the same way.
pub fn divide(limit: u64, demands: &[u64]) -> Vec<u64> {
    let n = demands.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let floor = if limit >= n { MILLI } else { 0 };
    let wants: Vec<u128> = demands.iter().map(|&d| u128::from(d.max(floor))).collect();
    // Water-filling in thousandths: the smallest demands are met first, each at most an equal
    // part of what is left.
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = u128::from(limit) * u128::from(MILLI);
    let mut given = vec![0u128; wants.len()];
    for (k, &i) in order.iter().enumerate() {
        let level = left / (wants.len() - k) as u128;
        given[i] = wants[i].min(level);
        left -= given[i];
    }
    // What nobody asked for, in equal parts.
    let each = left / wants.len() as u128;
    for g in &mut given {
        *g += each;
    }
    // Whole requests: the rest of the limit goes one by one to the largest remainders (the
    // larger demand first on a tie, then the earlier stream).
    let mut shares: Vec<u64> = given
        .iter()
        .map(|&g| (g / u128::from(MILLI)) as u64)
        .collect();
    let rest = limit - shares.iter().sum::<u64>();
    let mut by_remainder: Vec<usize> = (0..given.len()).collect();
    by_remainder.sort_by_key(|&i| {
        (
            std::cmp::Reverse(given[i] % u128::from(MILLI)),
            std::cmp::Reverse(wants[i]),
            i,
        )
    });
    for &i in by_remainder.iter().take(rest as usize) {
        shares[i] += 1;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_window(demands: &[u64]) -> Vec<u64> {
        demands.iter().map(|d| d * MILLI).collect()
    }

    #[test]
    fn streams_that_all_ask_too_much_get_equal_parts() {
        assert_eq!(divide(20, &per_window(&[30, 30])), [10, 10]);
        assert_eq!(divide(20, &per_window(&[30, 30, 30])), [6, 7, 7]);
    }

    #[test]
    fn a_small_demand_is_met_and_the_rest_goes_to_the_others() {
        assert_eq!(divide(20, &per_window(&[2, 30, 30])), [2, 9, 9]);
        assert_eq!(divide(100, &per_window(&[10, 20, 200])), [10, 20, 70]);
    }

    #[test]
    fn an_idle_stream_keeps_one_request_and_the_busy_one_gets_the_rest() {
        assert_eq!(divide(20, &per_window(&[0, 30])), [1, 19]);
    }

    #[test]
    fn what_nobody_asks_for_is_spread_evenly() {
        assert_eq!(divide(20, &per_window(&[2, 4])), [9, 11]);
        assert_eq!(divide(10, &per_window(&[0, 0, 0])), [4, 3, 3]);
    }

    #[test]
    fn fewer_requests_than_streams_leave_some_streams_none() {
        let shares = divide(2, &per_window(&[5, 5, 5]));
        assert_eq!(shares.iter().sum::<u64>(), 2);
        assert_eq!(shares.iter().filter(|&&s| s == 0).count(), 1);
    }

    #[test]
    fn shares_always_add_up_to_the_limit() {
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let limit = next() % 10_000;
            let n = (next() % 12 + 1) as usize;
            let demands: Vec<u64> = (0..n).map(|_| next() % (limit * MILLI + 2)).collect();
            let shares = divide(limit, &demands);
            assert_eq!(shares.iter().sum::<u64>(), limit, "{limit} {demands:?}");
            if limit >= n as u64 {
                assert!(
                    shares.iter().all(|&s| s >= 1),
                    "{limit} {demands:?} {shares:?}"
                );
            }
            // Max-min: a stream below its demand has at least as much as any other stream
            // (give or take the rounding to whole requests).
            for (i, &s) in shares.iter().enumerate() {
                if s * MILLI + MILLI < demands[i] {
                    assert!(
                        shares.iter().all(|&o| o <= s + 1),
                        "{limit} {demands:?} {shares:?}"
                    );
                }
            }
        }
    }
}
