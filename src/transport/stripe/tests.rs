use proptest::prelude::*;

use super::*;

fn pair(i: u32, len: u64) -> DescPair {
    DescPair {
        local_region: i % 3,
        local_off: 1000 * u64::from(i),
        remote_region: 7,
        remote_off: 5 + 300 * u64::from(i),
        len,
    }
}

/// Every descriptor is tiled exactly once by its slices, with matching remote offsets.
fn assert_tiles(descs: &[DescPair], slices: &[Slice]) {
    for (i, d) in descs.iter().enumerate() {
        let mut mine: Vec<&Slice> = slices.iter().filter(|s| s.desc == i).collect();
        mine.sort_by_key(|s| s.local_off);
        let mut at = d.local_off;
        for s in &mine {
            assert!(s.len > 0, "empty slice {s:?}");
            assert_eq!(
                s.local_off, at,
                "gap or overlap in descriptor {i}: {mine:?}"
            );
            assert_eq!(
                s.remote_off - d.remote_off,
                s.local_off - d.local_off,
                "{s:?} vs {d:?}"
            );
            assert_eq!(
                (s.local_region, s.remote_region),
                (d.local_region, d.remote_region)
            );
            at += s.len;
        }
        assert_eq!(
            at,
            d.local_off + d.len,
            "descriptor {i} not fully covered: {mine:?}"
        );
    }
}

fn all(plan: &Plan) -> Vec<Slice> {
    plan.per_rail.iter().flatten().copied().collect()
}

#[test]
fn stripe_width_values() {
    assert_eq!(
        StripeMode::from_stripe_width(None),
        Ok(StripeMode::PerTransfer)
    );
    assert_eq!(
        StripeMode::from_stripe_width(Some(0)),
        Ok(StripeMode::Striped)
    );
    let e = StripeMode::from_stripe_width(Some(2))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("2 is not allowed: leave stripe_width unset"),
        "{e}"
    );
    assert!(StripeMode::from_stripe_width(Some(-1)).is_err());
}

#[test]
fn per_transfer_spreads_by_load() {
    let mut p = Planner::new(2);
    let a = p
        .plan(&[pair(0, 1 << 20)], StripeMode::PerTransfer)
        .unwrap();
    let b = p.plan(&[pair(1, 4096)], StripeMode::PerTransfer).unwrap();
    assert_eq!(a.rails_used().len(), 1);
    assert_ne!(
        a.rails_used(),
        b.rails_used(),
        "the second transfer goes to the idle rail"
    );
    let busy = a.rails_used()[0];
    // the other rail has fewer bytes in flight: it keeps getting the work
    let c = p.plan(&[pair(2, 4096)], StripeMode::PerTransfer).unwrap();
    assert_ne!(c.rails_used()[0], busy);
    p.release(busy, 1 << 20);
    assert_eq!(p.in_flight(busy), 0);
}

#[test]
fn striping_two_rails_cuts_on_4k_boundaries() {
    let mut p = Planner::new(2);
    let descs = [pair(0, 100_000), pair(1, 100_000), pair(2, 1)];
    let plan = p.plan(&descs, StripeMode::Striped).unwrap();
    assert_eq!(plan.rails_used(), [0, 1]);
    let bytes: Vec<u64> = plan
        .per_rail
        .iter()
        .map(|s| s.iter().map(|s| s.len).sum())
        .collect();
    assert_eq!(bytes, [102_400, 97_601]); // share = ceil(200001 / 2) rounded up to 4 KiB
    assert_tiles(&descs, &all(&plan));
    assert_eq!(p.in_flight(0) + p.in_flight(1), 200_001);
}

#[test]
fn small_striped_transfers_use_one_rail_and_alternate() {
    let mut p = Planner::new(2);
    let a = p.plan(&[pair(0, 10_000)], StripeMode::Striped).unwrap();
    let b = p.plan(&[pair(1, 10_000)], StripeMode::Striped).unwrap();
    assert_eq!(a.rails_used().len(), 1);
    assert_ne!(a.rails_used(), b.rails_used());
}

#[test]
fn down_rails_get_nothing_and_none_up_is_an_error() {
    let mut p = Planner::new(2);
    p.set_up(1, false);
    let plan = p.plan(&[pair(0, 1 << 20)], StripeMode::Striped).unwrap();
    assert_eq!(plan.rails_used(), [0]);
    p.set_up(0, false);
    assert_eq!(p.plan(&[pair(0, 1)], StripeMode::PerTransfer), Err(NoRail));
    assert_eq!(
        NoRail.to_string(),
        "no rail is up: every rail to this peer has failed"
    );
}

#[test]
fn a_failed_rail_moves_its_slices_and_done_means_all_landed() {
    let mut p = Planner::new(2);
    let descs: Vec<DescPair> = (0..8).map(|i| pair(i, 64 * 1024)).collect();
    let plan = p.plan(&descs, StripeMode::Striped).unwrap();
    let mut prog = Progress::new(&plan);
    assert_eq!(prog.state(), XferState::InProgress);
    // rail 0 completes one slice, then fails; rail 1 finishes
    let first = prog.pending(0)[0];
    assert_eq!(prog.complete(0, 1), first.len);
    let n1 = prog.pending(1).len();
    prog.complete(1, n1);
    assert_eq!(
        prog.state(),
        XferState::InProgress,
        "rail 0 still owes slices"
    );
    let moved = prog.fail_rail(0);
    assert_eq!(moved.len(), plan.per_rail[0].len() - 1);
    p.set_up(0, false);
    let again = p.replan(&moved).unwrap();
    assert_eq!(again.rails_used(), [1]);
    prog.add(&again);
    assert_eq!(prog.state(), XferState::InProgress);
    let n = prog.pending(1).len();
    prog.complete(1, n);
    assert_eq!(prog.state(), XferState::Done);
    // what completed covers every byte exactly once
    let done: Vec<Slice> = std::iter::once(first)
        .chain(plan.per_rail[1].iter().copied())
        .chain(moved)
        .collect();
    assert_tiles(&descs, &done);
}

#[test]
fn no_survivor_means_failed_not_done() {
    let mut p = Planner::new(1);
    let plan = p.plan(&[pair(0, 4096)], StripeMode::PerTransfer).unwrap();
    let mut prog = Progress::new(&plan);
    let moved = prog.fail_rail(0);
    p.set_up(0, false);
    let e = p.replan(&moved).unwrap_err();
    prog.fail(e.to_string());
    assert_eq!(
        prog.state(),
        XferState::Failed("no rail is up: every rail to this peer has failed".into())
    );
    assert_eq!(
        prog.state().to_string(),
        "failed: no rail is up: every rail to this peer has failed"
    );
}

proptest! {
    #[test]
    fn plans_tile_every_descriptor(
        lens in prop::collection::vec(0u64..300_000, 1..40),
        rails in 1usize..5,
        down in prop::collection::vec(any::<bool>(), 4),
        striped in any::<bool>(),
    ) {
        let mut p = Planner::new(rails);
        for (r, d) in down.iter().enumerate().take(rails - 1) {
            p.set_up(r + 1, !d); // rail 0 always up
        }
        let descs: Vec<DescPair> = lens.iter().enumerate().map(|(i, &l)| pair(i as u32, l)).collect();
        let mode = if striped { StripeMode::Striped } else { StripeMode::PerTransfer };
        let plan = p.plan(&descs, mode).unwrap();
        assert_tiles(&descs, &all(&plan));
        let total: u64 = lens.iter().sum();
        let planned: u64 = (0..rails).map(|r| p.in_flight(r)).sum();
        prop_assert_eq!(planned, total);
        for r in plan.rails_used() {
            prop_assert!(p.up_rails().contains(&r), "work on a down rail {}", r);
        }
        if !striped {
            prop_assert!(plan.rails_used().len() <= 1);
        } else if total >= MIN_STRIPE * p.up_rails().len() as u64 {
            prop_assert_eq!(plan.rails_used().len(), p.up_rails().len());
        }
        // completing everything, rail by rail, is Done
        let mut prog = Progress::new(&plan);
        for r in 0..rails {
            let n = prog.pending(r).len();
            prog.complete(r, n);
        }
        prop_assert_eq!(prog.state(), XferState::Done);
    }
}
