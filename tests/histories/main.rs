//! Generated histories, on `redis-server`: replicas of sluice driven through seeded sequences of
//! loads, restarts and store outages, checked at every answer (leased counters, holds, the quota
//! service's grants, split limits). Long and timing-sensitive, so a binary of their own: about 3 minutes of
//! tests on 2 cores.

mod hold_histories;
mod lease_histories;
mod rlqs_histories;
mod split_histories;
