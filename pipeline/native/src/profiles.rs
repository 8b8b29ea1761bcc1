//! An OTLP `ExportProfilesServiceRequest` (v1development, OTLP 1.10) split by the trace of
//! each sample's link, on its wire bytes: `pipeline/otlp/wire_profiles.py`'s
//! `split_profile_bytes`, byte for byte. Samples are cut out in runs and no index in them
//! changes; each part carries the request's dictionary as received but for its links: the
//! links its samples name stay at their index, the others become empty entries of two
//! bytes (none after the last one named).
//!
//! The request was checked before (`pipeline/otlp/profiles.py`): here only the structure
//! the split reads is walked, bounds checked as everywhere, and anything unexpected (a
//! field the split does not know at the levels it copies, a link index or trace id given
//! twice, a second dictionary) hands the request back to the Python path.
//!
//! Field numbers: ExportProfilesServiceRequest `resource_profiles = 1`, `dictionary = 2`;
//! ResourceProfiles / ScopeProfiles: 1 resource or scope, 2 the nested list, 3
//! schema_url; Profile `samples = 2` (its other fields are carried as they are); Sample
//! `link_index = 3`; ProfilesDictionary `link_table = 4`; Link `trace_id = 1`.

use crate::{copy, copy_runs, field, fields, only, order_by_group, outer_runs, put_header,
            ranges_len, runs, want, Field, Groups, Keying, Nest, Refused, LEN, VARINT};

/// The dictionary's copies may always add this many bytes (wire_profiles.py's `ROOM`).
const ROOM: usize = 1 << 16;
/// An empty link_table entry (ProfilesDictionary field 4, no bytes).
const NO_LINK: [u8; 2] = [0x22, 0x00];


struct Request {
    nest: Nest,
    profile_heads: Vec<Vec<(usize, usize)>>,
    profile_scope: Vec<u32>,
    samples: Vec<(u32, usize, usize, u32)>, // (profile index, start, end, link index)
    dictionary_rest: Vec<(usize, usize)>,    // the dictionary's fields but its links
    links: Vec<(usize, usize, Option<usize>)>, // each link (whole field), its trace id
}

/// A Sample's link index (0 when absent); None when given twice or not a varint.
fn sample_link(b: &[u8], f: &Field) -> Option<u32> {
    match only(b, f.p, f.q, 3)? {
        None => Some(0),
        Some(g) => {
            want(&g, VARINT)?;
            u32::try_from(g.v).ok() // negative: refused before; unsure here
        }
    }
}

fn link_trace_id(b: &[u8], f: &Field) -> Option<Option<usize>> {
    let g = match only(b, f.p, f.q, 1)? {
        None => return Some(None),
        Some(g) => g,
    };
    want(&g, LEN)?;
    let tid = b.get(g.p..g.q)?;
    if tid.iter().all(|&x| x == 0) {
        Some(None)
    } else if tid.len() == 16 {
        Some(Some(g.p))
    } else {
        None // a non-zero trace id of another length: refused before
    }
}

fn walk(b: &[u8]) -> Option<Request> {
    let mut req = Request {
        nest: Nest::default(),
        profile_heads: Vec::new(),
        profile_scope: Vec::new(),
        samples: Vec::new(),
        dictionary_rest: Vec::new(),
        links: Vec::new(),
    };
    let mut dictionaries = 0;
    let (profile_heads, profile_scope, samples) =
        (&mut req.profile_heads, &mut req.profile_scope, &mut req.samples);
    let (rest, links) = (&mut req.dictionary_rest, &mut req.links);
    fields(b, 0, b.len(), |top| match top.num {
        1 => req.nest.resource(b, top, None, |si, h| {
            let pi = u32::try_from(profile_heads.len()).ok()?;
            let mut phead = Vec::new();
            let mut i = h.p;
            while i < h.q {
                let s = field(b, &mut i, h.q)?;
                if s.num == 2 {
                    want(&s, LEN)?;
                    samples.push((pi, s.start, s.q, sample_link(b, &s)?));
                } else {
                    phead.push((s.start, s.q));
                }
            }
            profile_heads.push(phead);
            profile_scope.push(si);
            Some(())
        }),
        2 => {
            want(top, LEN)?;
            dictionaries += 1;
            if dictionaries > 1 {
                return None; // merged by upb; rare: the Python path
            }
            fields(b, top.p, top.q, |g| {
                if g.num == 4 {
                    want(g, LEN)?;
                    links.push((g.start, g.q, link_trace_id(b, g)?));
                } else {
                    rest.push((g.start, g.q));
                }
                Some(())
            })
        }
        _ => None,
    })?;
    Some(req)
}

/// The parts: (trace id offset of the key, or u64::MAX for the samples without a trace,
/// start, end) in `buf`, ordered by their first sample.
/// (`_limit`: a part per partition bounds what the copies add, as in Python.)
pub(crate) fn split(b: &[u8], keying: Keying, _limit: usize, buf: &mut Vec<u8>,
                    idx: &mut Vec<u64>) -> Result<(), Refused> {
    let req = walk(b).ok_or(Refused::Unsure)?;
    if matches!(keying, Keying::Trace) {
        return Err(Refused::TooLarge); // a part per trace repeats the tables: compact
    }
    // each sample's group: the partition of its link's trace (or the group of samples
    // without one), numbered in order of first appearance
    const NONE: u32 = u32::MAX;
    let mut by_link: Vec<u32> = vec![NONE; req.links.len().max(1)];
    let mut groups = Groups::new(keying);
    let mut group_of: Vec<u32> = Vec::with_capacity(req.samples.len());
    let mut no_trace_group = NONE;
    for &(_, _, _, li) in &req.samples {
        // an index past the table (refused before) names no trace, as in Python
        let slot = if (li as usize) < by_link.len() { li as usize } else { 0 };
        let known = if slot == li as usize { by_link[slot] } else { NONE };
        let g = match known {
            g if g != NONE => g,
            _ => {
                let tid = if li > 0 {
                    req.links.get(li as usize).and_then(|l| l.2)
                } else {
                    None
                };
                let g = match tid {
                    None => {
                        if no_trace_group == NONE {
                            no_trace_group = groups.add(u64::MAX);
                        }
                        no_trace_group
                    }
                    Some(t) => groups.of_trace(b.get(t..t + 16).ok_or(Refused::Unsure)?,
                                               t as u64),
                };
                if slot == li as usize {
                    by_link[slot] = g;
                }
                g
            }
        };
        group_of.push(g);
    }
    let group_key = &groups.key;
    let groups = group_key.len();
    let (first, order) = order_by_group(&group_of, groups);
    // the link indices each part names, and what the parts' dictionaries add
    let rest_len = ranges_len(&req.dictionary_rest);
    let mut used: Vec<Vec<u32>> = Vec::with_capacity(groups);
    let mut extra = rest_len.saturating_mul(groups.saturating_sub(1));
    for g in 0..groups {
        let mut u: Vec<u32> = order[first[g]..first[g + 1]]
            .iter().map(|&s| req.samples[s as usize].3).collect();
        u.sort_unstable();
        u.dedup();
        extra += NO_LINK.len() * *u.last().unwrap_or(&0) as usize;
        used.push(u);
    }
    if extra > b.len().max(ROOM) {
        return Err(Refused::TooLarge);
    }
    let (mut profiles, mut scopes, mut resources) = (Vec::new(), Vec::new(), Vec::new());
    for g in 0..groups {
        let samples = &order[first[g]..first[g + 1]];
        let sample = |s: u32| req.samples[s as usize];
        // runs of one profile, of one scope, of one resource, with their messages' sizes
        runs(samples, |s| sample(s).0, |pi| ranges_len(&req.profile_heads[pi as usize]),
             |s| sample(s).2 - sample(s).1, &mut profiles);
        outer_runs(&profiles, &req.profile_scope, &req.nest.scope_heads, &mut scopes);
        outer_runs(&scopes, &req.nest.scope_resource, &req.nest.resource_heads, &mut resources);
        let msg_start = buf.len();
        req.nest.put(buf, b, &resources, &scopes, |buf, sc| {
            for prof in &profiles[sc.from..sc.to] {
                put_header(buf, 2, prof.size);
                copy(buf, b, &req.profile_heads[prof.key as usize]);
                copy_runs(buf, b, &samples[prof.from..prof.to], |s| (sample(s).1, sample(s).2));
            }
        });
        // the dictionary: its tables, and the links this part names (and the zero entry)
        let mut size = rest_len;
        let mut at = 0usize;
        let zero = [0u32];
        let named = merge_zero(&used[g], &zero);
        for &i in &named {
            let i = i as usize;
            if i >= req.links.len() {
                break;
            }
            size += NO_LINK.len() * (i - at) + (req.links[i].1 - req.links[i].0);
            at = i + 1;
        }
        put_header(buf, 2, size);
        copy(buf, b, &req.dictionary_rest);
        at = 0;
        for &i in &named {
            let i = i as usize;
            if i >= req.links.len() {
                break;
            }
            for _ in at..i {
                buf.extend_from_slice(&NO_LINK);
            }
            buf.extend_from_slice(&b[req.links[i].0..req.links[i].1]);
            at = i + 1;
        }
        idx.extend_from_slice(&[group_key[g], msg_start as u64, buf.len() as u64]);
    }
    Ok(())
}

/// `used` (sorted, unique) with index 0 in it.
fn merge_zero(used: &[u32], zero: &[u32]) -> Vec<u32> {
    if used.first() == Some(&0) {
        used.to_vec()
    } else {
        let mut v = zero.to_vec();
        v.extend_from_slice(used);
        v
    }
}

/// A usual Sample (`stack_index = 1`, `link_index = 3`, one value in a packed
/// `values = 4`, each at most once, indices within int32, the value not negative):
/// (stack, link, value); None for any other sample.
fn usual_sample(b: &[u8], f: &Field) -> Option<(u64, u64, u64)> {
    let (mut stack, mut link, mut value) = (None, None, None);
    fields(b, f.p, f.q, |g| match g.num {
        1 | 3 => {
            want(g, VARINT)?;
            let slot = if g.num == 1 { &mut stack } else { &mut link };
            if slot.is_some() || g.v > i32::MAX as u64 {
                return None;
            }
            *slot = Some(g.v);
            Some(())
        }
        4 => {
            want(g, LEN)?;
            let mut i = g.p;
            let v = crate::varint(b, &mut i, g.q)?;
            if value.is_some() || i != g.q || v > i64::MAX as u64 {
                return None;
            }
            value = Some(v);
            Some(())
        }
        _ => None,
    })?;
    Some((stack.unwrap_or(0), link.unwrap_or(0), value?))
}

/// Each profile's samples as columns, for the gateway's checks of a request upb parsed
/// (`pipeline/otlp/profiles.py`): `[profiles, then (usual, samples) for each, then for
/// each usual profile its stacks, links and values]`; a profile is usual when all its
/// samples are. None when the request's structure is not what this walk expects.
pub fn columns(b: &[u8]) -> Option<Vec<u64>> {
    let mut heads: Vec<(u64, u64)> = Vec::new();
    let mut cols: Vec<u64> = Vec::new();
    let (mut stacks, mut links, mut values) = (Vec::new(), Vec::new(), Vec::new());
    fields(b, 0, b.len(), |top| {
        want(top, LEN)?;
        if top.num != 1 {
            return if top.num == 2 { Some(()) } else { None };
        }
        fields(b, top.p, top.q, |g| {
            want(g, LEN)?;
            if g.num != 2 {
                return Some(());
            }
            fields(b, g.p, g.q, |h| {
                want(h, LEN)?;
                if h.num != 2 {
                    return Some(());
                }
                stacks.clear();
                links.clear();
                values.clear();
                let mut usual = true;
                let mut n = 0u64;
                let mut i = h.p;
                while i < h.q {
                    let s = field(b, &mut i, h.q)?;
                    if s.num != 2 {
                        continue;
                    }
                    want(&s, LEN)?;
                    n += 1;
                    if usual {
                        match usual_sample(b, &s) {
                            Some((st, lk, v)) => {
                                stacks.push(st);
                                links.push(lk);
                                values.push(v);
                            }
                            None => usual = false,
                        }
                    }
                }
                heads.push((u64::from(usual), n));
                if usual {
                    cols.extend_from_slice(&stacks);
                    cols.extend_from_slice(&links);
                    cols.extend_from_slice(&values);
                }
                Some(())
            })
        })
    })?;
    let mut out = Vec::with_capacity(1 + 2 * heads.len() + cols.len());
    out.push(heads.len() as u64);
    for (usual, n) in heads {
        out.extend_from_slice(&[usual, n]);
    }
    out.extend_from_slice(&cols);
    Some(out)
}

/// What `dictionary` found: table sizes, and bounds on what any use of the tables can
/// charge to a request's stack budget (`pipeline/otlp/stacks.py`).
pub struct Summary {
    pub strings: u64,
    pub links: u64,
    pub stacks: u64,
    /// the most frames of one stack or location (inlined lines included), and the most
    /// location references of one stack
    pub depth: u64,
    /// frames beyond `fanout` per location reference, added over the stacks that have any
    pub excess: u64,
    /// name characters of every location, and frame bytes of every stack
    pub text: u64,
}

/// The values of a repeated int32 field (packed or not) given to `each`.
fn int32s(b: &[u8], f: &Field, mut each: impl FnMut(u64) -> Option<()>) -> Option<()> {
    match f.wire {
        VARINT => each(f.v),
        LEN => {
            let mut i = f.p;
            while i < f.q {
                each(crate::varint(b, &mut i, f.q)?)?;
            }
            Some(())
        }
        _ => None,
    }
}

/// Singular scalar fields of one entry: (number, value) for those named in `nums`, each
/// at most once and a varint; other numbers skipped (LEN ones given to `other`).
fn entry(b: &[u8], f: &Field, nums: &[u32], vals: &mut [Option<u64>],
         mut other: impl FnMut(&Field) -> Option<()>) -> Option<()> {
    fields(b, f.p, f.q, |g| {
        if let Some(k) = nums.iter().position(|&n| n == g.num) {
            want(g, VARINT)?;
            if vals[k].is_some() {
                return None;
            }
            vals[k] = Some(g.v);
            Some(())
        } else {
            other(g)
        }
    })
}

fn chars(s: &[u8]) -> u64 {
    s.iter().filter(|&&x| x & 0xC0 != 0x80).count() as u64
}

/// Every entry of the request's ProfilesDictionary checked as `pipeline/otlp/dictionary.py`
/// checks the entries a profile uses (indices in range, links of the right lengths), so
/// that a gateway may skip those checks; with `fanout`, bounds on the stack budget any use
/// can spend. None when an entry is wrong, unusual (a field given twice, an index past
/// int32), or the request has not exactly one dictionary.
pub fn dictionary(b: &[u8], fanout: u64) -> Option<Summary> {
    let dict = only(b, 0, b.len(), 2)??;
    want(&dict, LEN)?;
    let (dp, dq) = (dict.p, dict.q);
    let mut tables: [Vec<(usize, usize)>; 8] = Default::default();
    fields(b, dp, dq, |g| {
        if (1..=7).contains(&g.num) {
            want(g, LEN)?;
            tables[g.num as usize].push((g.p, g.q));
        }
        Some(())
    })?;
    let n = |t: usize| tables[t].len() as u64;
    // locations and functions are checked by index into the vectors below
    let (n_map, n_link, n_str, n_attr, n_stack) = (n(1), n(4), n(5), n(6), n(7));
    let as_field = |(p, q): (usize, usize)| Field { num: 0, wire: LEN, start: p, p, q, v: 0 };
    let string = |i: Option<u64>| if i.unwrap_or(0) < n_str { Some(()) } else { None };
    let attr_list = |g: &Field| int32s(b, g, |a| if a < n_attr { Some(()) } else { None });
    for &e in &tables[6] {
        let mut v = [None, None];
        entry(b, &as_field(e), &[1, 3], &mut v, |_| Some(()))?;
        string(v[0])?;
        string(v[1])?;
    }
    for &e in &tables[1] {
        let mut v = [None];
        entry(b, &as_field(e), &[4], &mut v, |g| if g.num == 5 { attr_list(g) } else { Some(()) })?;
        string(v[0])?;
    }
    // functions: their names' characters and frame bytes (name, NUL, file, 8 bytes)
    let mut fn_text: Vec<(u64, u64)> = Vec::with_capacity(tables[3].len());
    for &e in &tables[3] {
        let mut v = [None, None, None];
        entry(b, &as_field(e), &[1, 2, 3], &mut v, |_| Some(()))?;
        for x in v {
            string(Some(x.unwrap_or(0)))?;
        }
        let s = |i: Option<u64>| tables[5].get(i.unwrap_or(0) as usize).copied();
        let (name, file) = (s(v[0])?, s(v[2])?);
        let (name, file) = (b.get(name.0..name.1)?, b.get(file.0..file.1)?);
        fn_text.push((chars(name) + chars(file), (name.len() + 1 + file.len() + 8) as u64));
    }
    // locations: (frames, bytes of frames), and their names' characters into `text`
    let mut text: u64 = 0;
    let mut depth: u64 = 0;
    let mut loc: Vec<(u64, u64)> = Vec::with_capacity(tables[2].len());
    for &e in &tables[2] {
        let mut v = [None, None];
        let (mut lines, mut bytes) = (0u64, 0u64);
        entry(b, &as_field(e), &[1, 2], &mut v, |g| match g.num {
            3 => {
                want(g, LEN)?;
                let mut lv = [None];
                entry(b, g, &[1], &mut lv, |_| Some(()))?;
                let fi = lv[0].unwrap_or(0);
                let (c, by) = *fn_text.get(usize::try_from(fi).ok()?)?;
                lines += 1;
                text = text.saturating_add(c);
                bytes = bytes.saturating_add(by);
                Some(())
            }
            4 => attr_list(g),
            _ => Some(()),
        })?;
        let mi = v[0].unwrap_or(0);
        if !(mi < n_map || (n_map == 0 && mi == 0)) {
            return None;
        }
        if lines == 0 {
            let addr = format!("0x{:x}", v[1].unwrap_or(0)).len() as u64;
            text = text.saturating_add(addr);
            bytes = addr + 1 + 8;
            lines = 1;
        }
        depth = depth.max(lines);
        loc.push((lines, bytes));
    }
    let mut excess: u64 = 0;
    for &e in &tables[7] {
        let (mut frames, mut refs, mut bytes) = (0u64, 0u64, 0u64);
        fields(b, e.0, e.1, |g| {
            if g.num != 1 {
                return Some(());
            }
            int32s(b, g, |li| {
                let (f, by) = *loc.get(usize::try_from(li).ok()?)?;
                frames = frames.saturating_add(f);
                refs += 1;
                bytes = bytes.saturating_add(by);
                Some(())
            })
        })?;
        depth = depth.max(frames).max(refs);
        // saturating: a huge request must not wrap into a small bound
        excess = excess.saturating_add(frames.saturating_sub(fanout.saturating_mul(refs)));
        text = text.saturating_add(bytes);
    }
    for &e in &tables[4] {
        let (mut tid, mut sid) = (None, None);
        fields(b, e.0, e.1, |g| {
            if g.num == 1 || g.num == 2 {
                want(g, LEN)?;
                let slot = if g.num == 1 { &mut tid } else { &mut sid };
                if slot.is_some() {
                    return None;
                }
                *slot = Some(b.get(g.p..g.q)?);
            }
            Some(())
        })?;
        let (t, s) = (tid.unwrap_or(&[]), sid.unwrap_or(&[]));
        let zero = |x: &[u8]| x.iter().all(|&c| c == 0);
        if !((zero(t) && zero(s)) || (t.len() == 16 && s.len() == 8 && !zero(s))) {
            return None;
        }
    }
    Some(Summary { strings: n_str, links: n_link, stacks: n_stack, depth, excess, text })
}
