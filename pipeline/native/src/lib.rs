//! An OTLP `ExportTraceServiceRequest` checked and split by trace on its wire bytes.
//!
//! The gateway's Python path parses a request with upb, checks every span in Python and
//! cuts it into one message per partition (`pipeline/otlp/traces.py`, `wire.py`): about
//! 3.9 us a span. Here the same work is one walk over the bytes.
//!
//! The walk is conservative: it accepts a request only when it is sure that upb parses it
//! and that every span passes the gateway's checks. Anything else (a field this schema
//! does not name, a field with another wire type, a span that would be refused, an id or
//! time given twice, values nested deeper than `MAX_VALUE_DEPTH`, a tag not written in its
//! shortest form) makes it answer "not handled" (`None`, -1 at the boundary), and the
//! caller takes the Python path, which names the problem. So the Python path stays the
//! reference, and a test compares the two on generated requests (tests/fuzz).
//!
//! Checks, as `pipeline/otlp/traces.py` makes them: trace_id 16 bytes and not all zero,
//! span_id 8 bytes and not all zero, parent_span_id empty or 8 bytes, start <= end <
//! 2106-01-01 (`bounds.TIME_MAX_NS`), every event's time below that too, links' ids empty
//! or 16 / 8 bytes. Every string field is valid UTF-8 (what upb checks for proto3).
//!
//! Field numbers: opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto,
//! resource/v1/resource.proto.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

mod profiles;

/// 2106-01-01T00:00:00Z in ns (`pipeline/otlp/bounds.py`).
const TIME_MAX_NS: u64 = 4_291_747_200 * 1_000_000_000;
/// AnyValue inside AnyValue (arrays, kvlists) this deep at most; upb's own limit is 100
/// messages in all, and a request's spans sit 5 deep.
const MAX_VALUE_DEPTH: u32 = 16;

pub(crate) const VARINT: u8 = 0;
pub(crate) const I64: u8 = 1;
pub(crate) const LEN: u8 = 2;
pub(crate) const I32: u8 = 5;

/// One field: its number and wire type, where it starts (its tag), where its payload
/// starts and ends (for LEN: the bytes; else the value's bytes), and a scalar's value.
#[derive(Clone, Copy)]
pub(crate) struct Field {
    pub(crate) num: u32,
    pub(crate) wire: u8,
    pub(crate) start: usize,
    pub(crate) p: usize,
    pub(crate) q: usize,
    pub(crate) v: u64,
}

#[inline(always)]
pub(crate) fn varint(b: &[u8], i: &mut usize, end: usize) -> Option<u64> {
    if *i < end {
        let x = *b.get(*i)?;
        if x < 0x80 {
            *i += 1;
            return Some(u64::from(x)); // one byte: most tags, lengths and small values
        }
    }
    varint_long(b, i, end)
}

/// A varint of more than one byte, only in its shortest form: upb refuses some longer
/// ones (a length of 0 in seven bytes) and no client writes them.
#[inline(never)]
fn varint_long(b: &[u8], i: &mut usize, end: usize) -> Option<u64> {
    let start = *i;
    let v = varint_any(b, i, end)?;
    if *i - start != varint_len(v) {
        return None;
    }
    Some(v)
}

fn varint_any(b: &[u8], i: &mut usize, end: usize) -> Option<u64> {
    let mut v: u64 = 0;
    let mut shift = 0u32;
    loop {
        if *i >= end {
            return None;
        }
        let x = *b.get(*i)?;
        *i += 1;
        if shift == 63 && x > 1 {
            return None; // beyond 64 bits
        }
        v |= u64::from(x & 0x7F) << shift;
        if x < 0x80 {
            return Some(v);
        }
        shift += 7;
        if shift > 63 {
            return None;
        }
    }
}

#[inline]
#[allow(clippy::manual_div_ceil)] // usize::div_ceil is newer than Debian's rustc
fn varint_len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    (bits + 6) / 7
}

/// The field at `*i` (before `end`), or None when it is not one this walk accepts.
#[inline(always)]
pub(crate) fn field(b: &[u8], i: &mut usize, end: usize) -> Option<Field> {
    let start = *i;
    let tag = match b.get(start) {
        Some(&t) if t < 0x80 && start < end => {
            *i += 1;
            u64::from(t) // fields 1-15: one byte
        }
        _ => {
            let tag = varint_long(b, i, end)?;
            if tag > u64::from(u32::MAX) {
                return None; // a field number past 2^29
            }
            tag
        }
    };
    let num = (tag >> 3) as u32;
    let wire = (tag & 7) as u8;
    if num == 0 {
        return None;
    }
    let p = *i;
    let (q, v) = match wire {
        VARINT => {
            let v = varint(b, i, end)?;
            (*i, v)
        }
        I64 => {
            let q = p.checked_add(8)?;
            if q > end {
                return None;
            }
            (q, u64::from_le_bytes(b.get(p..q)?.try_into().ok()?))
        }
        I32 => {
            let q = p.checked_add(4)?;
            if q > end {
                return None;
            }
            (q, u64::from(u32::from_le_bytes(b.get(p..q)?.try_into().ok()?)))
        }
        LEN => {
            let n = varint(b, i, end)?;
            if n > i32::MAX as u64 {
                return None; // upb's limit for a length
            }
            let p = *i;
            let q = p.checked_add(usize::try_from(n).ok()?)?;
            if q > end {
                return None;
            }
            *i = q;
            return Some(Field { num, wire, start, p, q, v: n });
        }
        _ => return None, // groups: not in these messages
    };
    *i = q;
    Some(Field { num, wire, start, p, q, v })
}

/// Calls `each` with every field of `b[p..q]`; None as soon as one is refused.
#[inline]
pub(crate) fn fields(b: &[u8], p: usize, q: usize, mut each: impl FnMut(&Field) -> Option<()>) -> Option<()> {
    let mut i = p;
    while i < q {
        let f = field(b, &mut i, q)?;
        each(&f)?;
    }
    Some(())
}

/// The one field numbered `num` in `b[p..q]`: `Some(None)` when there is none, None when
/// there are several (upb would keep the last: the Python path decides) or the bytes are
/// not fields this walk accepts.
pub(crate) fn only(b: &[u8], p: usize, q: usize, num: u32) -> Option<Option<Field>> {
    let mut got = None;
    fields(b, p, q, |g| {
        if g.num == num {
            if got.is_some() {
                return None;
            }
            got = Some(*g);
        }
        Some(())
    })?;
    Some(got)
}

#[inline]
fn utf8(b: &[u8], f: &Field) -> Option<()> {
    let s = b.get(f.p..f.q)?;
    if s.is_ascii() || std::str::from_utf8(s).is_ok() {
        Some(())
    } else {
        None
    }
}

#[inline]
pub(crate) fn want(f: &Field, wire: u8) -> Option<()> {
    if f.wire == wire {
        Some(())
    } else {
        None
    }
}

fn any_value(b: &[u8], f: &Field, depth: u32) -> Option<()> {
    if depth > MAX_VALUE_DEPTH {
        return None;
    }
    fields(b, f.p, f.q, |g| match g.num {
        1 => want(g, LEN).and_then(|_| utf8(b, g)),        // string_value
        2 | 3 => want(g, VARINT),                           // bool_value, int_value
        4 => want(g, I64),                                  // double_value
        5 => want(g, LEN).and_then(|_| values(b, g, depth)), // array_value
        6 => want(g, LEN).and_then(|_| kv_list(b, g, depth)), // kvlist_value
        7 => want(g, LEN),                                  // bytes_value
        _ => None,
    })
}

/// ArrayValue: `values = 1` (AnyValue).
fn values(b: &[u8], f: &Field, depth: u32) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        1 => want(g, LEN).and_then(|_| any_value(b, g, depth + 1)),
        _ => None,
    })
}

/// KeyValueList: `values = 1` (KeyValue).
fn kv_list(b: &[u8], f: &Field, depth: u32) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        1 => want(g, LEN).and_then(|_| key_value(b, g, depth + 1)),
        _ => None,
    })
}

/// KeyValue: `key = 1`, `value = 2`.
fn key_value(b: &[u8], f: &Field, depth: u32) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        1 => want(g, LEN).and_then(|_| utf8(b, g)),
        2 => want(g, LEN).and_then(|_| any_value(b, g, depth)),
        _ => None,
    })
}

/// Resource: `attributes = 1`, `dropped_attributes_count = 2`.
fn resource(b: &[u8], f: &Field) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        1 => want(g, LEN).and_then(|_| key_value(b, g, 0)),
        2 => want(g, VARINT),
        _ => None,
    })
}

/// InstrumentationScope: `name = 1`, `version = 2`, `attributes = 3`,
/// `dropped_attributes_count = 4`.
fn scope(b: &[u8], f: &Field) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        1 | 2 => want(g, LEN).and_then(|_| utf8(b, g)),
        3 => want(g, LEN).and_then(|_| key_value(b, g, 0)),
        4 => want(g, VARINT),
        _ => None,
    })
}

/// Status: `message = 2`, `code = 3`.
fn status(b: &[u8], f: &Field) -> Option<()> {
    fields(b, f.p, f.q, |g| match g.num {
        2 => want(g, LEN).and_then(|_| utf8(b, g)),
        3 => want(g, VARINT),
        _ => None,
    })
}

/// Span.Event: `time_unix_nano = 1`, `name = 2`, `attributes = 3`,
/// `dropped_attributes_count = 4`; its time storable.
fn event(b: &[u8], f: &Field) -> Option<()> {
    let mut time = false;
    fields(b, f.p, f.q, |g| match g.num {
        1 => {
            want(g, I64)?;
            if time || g.v >= TIME_MAX_NS {
                return None;
            }
            time = true;
            Some(())
        }
        2 => want(g, LEN).and_then(|_| utf8(b, g)),
        3 => want(g, LEN).and_then(|_| key_value(b, g, 0)),
        4 => want(g, VARINT),
        _ => None,
    })
}

/// Span.Link: `trace_id = 1`, `span_id = 2`, `trace_state = 3`, `attributes = 4`,
/// `dropped_attributes_count = 5`, `flags = 6`; ids empty or of their length.
fn link(b: &[u8], f: &Field) -> Option<()> {
    let (mut tid, mut sid) = (false, false);
    fields(b, f.p, f.q, |g| match g.num {
        1 | 2 => {
            want(g, LEN)?;
            let (seen, size) = if g.num == 1 { (&mut tid, 16) } else { (&mut sid, 8) };
            let n = g.q - g.p;
            if *seen || (n != 0 && n != size) {
                return None;
            }
            *seen = true;
            Some(())
        }
        3 => want(g, LEN).and_then(|_| utf8(b, g)),
        4 => want(g, LEN).and_then(|_| key_value(b, g, 0)),
        5 => want(g, VARINT),
        6 => want(g, I32),
        _ => None,
    })
}

#[inline]
fn all_zero(s: &[u8]) -> bool {
    s.iter().all(|&x| x == 0)
}

/// A Span that passes every check: the offset of its trace id's 16 bytes.
fn span(b: &[u8], f: &Field) -> Option<usize> {
    let (mut tid, mut sid, mut parent) = (None::<usize>, false, false);
    let (mut start, mut end) = (None::<u64>, None::<u64>);
    fields(b, f.p, f.q, |g| match g.num {
        1 => {
            want(g, LEN)?;
            if tid.is_some() || g.q - g.p != 16 || all_zero(b.get(g.p..g.q)?) {
                return None;
            }
            tid = Some(g.p);
            Some(())
        }
        2 => {
            want(g, LEN)?;
            if sid || g.q - g.p != 8 || all_zero(b.get(g.p..g.q)?) {
                return None;
            }
            sid = true;
            Some(())
        }
        4 => {
            want(g, LEN)?;
            let n = g.q - g.p;
            if parent || (n != 0 && n != 8) {
                return None;
            }
            parent = true;
            Some(())
        }
        3 | 5 => want(g, LEN).and_then(|_| utf8(b, g)), // trace_state, name
        6 | 10 | 12 | 14 => want(g, VARINT), // kind, dropped counts
        7 | 8 => {
            want(g, I64)?;
            let slot = if g.num == 7 { &mut start } else { &mut end };
            if slot.is_some() {
                return None;
            }
            *slot = Some(g.v);
            Some(())
        }
        9 => want(g, LEN).and_then(|_| key_value(b, g, 0)),
        11 => want(g, LEN).and_then(|_| event(b, g)),
        13 => want(g, LEN).and_then(|_| link(b, g)),
        15 => want(g, LEN).and_then(|_| status(b, g)),
        16 => want(g, I32), // flags
        _ => None,
    })?;
    let (s, e) = (start.unwrap_or(0), end.unwrap_or(0));
    if !sid || s > e || e >= TIME_MAX_NS {
        return None;
    }
    tid
}

/// A span's trace id (offset of its 16 bytes) without checking the rest: for a request
/// checked already (by `walk` at the receiver, or parsed and checked by the Python path).
/// One trace_id field of 16 bytes, or the Python path decides.
fn span_trace_id(b: &[u8], f: &Field) -> Option<usize> {
    if f.q - f.p > 18 && b.get(f.p..f.p + 2)? == [0x0A, 16] {
        // the usual order: trace_id first; no second one further on
        let mut i = f.p + 18;
        while i < f.q {
            if field(b, &mut i, f.q)?.num == 1 {
                return None;
            }
        }
        return Some(f.p + 2);
    }
    match only(b, f.p, f.q, 1)? {
        Some(g) if g.wire == LEN && g.q - g.p == 16 => Some(g.p),
        _ => None,
    }
}

/// What the walk keeps for the split: each resource's and scope's own fields (`Nest`),
/// and each span (whole field) with its trace id.
#[derive(Default)]
struct Request {
    nest: Nest,
    spans: Vec<(u32, usize, usize, usize)>, // (scope index, start, end, trace id offset)
}

/// A check of a resource's or a scope's own field.
pub(crate) type Check = fn(&[u8], &Field) -> Option<()>;

/// The heads of a request's resources and scopes (ResourceSpans / ResourceProfiles:
/// `resource = 1`, the scopes `= 2`, `schema_url = 3`; ScopeSpans / ScopeProfiles:
/// `scope = 1`, the spans or profiles `= 2`, `schema_url = 3`): their own fields, whole and
/// in order, for a split to copy, and which resource each scope is in.
#[derive(Default)]
pub(crate) struct Nest {
    pub(crate) resource_heads: Vec<Vec<(usize, usize)>>,
    pub(crate) scope_heads: Vec<Vec<(usize, usize)>>,
    pub(crate) scope_resource: Vec<u32>,
}

impl Nest {
    /// The messages of `resources`: each its header and head, then its scopes
    /// (`scopes[from..to]`), each its header and head, then what `inner` writes of it.
    pub(crate) fn put(&self, buf: &mut Vec<u8>, b: &[u8], resources: &[Run], scopes: &[Run],
                      mut inner: impl FnMut(&mut Vec<u8>, &Run)) {
        for res in resources {
            put_header(buf, 1, res.size);
            copy(buf, b, &self.resource_heads[res.key as usize]);
            for sc in &scopes[res.from..res.to] {
                put_header(buf, 2, sc.size);
                copy(buf, b, &self.scope_heads[sc.key as usize]);
                inner(buf, sc);
            }
        }
    }

    /// One resource entry `rs` walked: its heads kept (the resource and the scopes checked
    /// with `checks`, their schema_urls as UTF-8, when given), each item of each scope
    /// given to `item` with the scope's index. None for any other field.
    pub(crate) fn resource(&mut self, b: &[u8], rs: &Field, checks: Option<(Check, Check)>,
                           mut item: impl FnMut(u32, &Field) -> Option<()>) -> Option<()> {
        want(rs, LEN)?;
        let ri = u32::try_from(self.resource_heads.len()).ok()?;
        let url: Option<Check> = checks.map(|_| utf8 as Check);
        let mut head = Vec::new();
        fields(b, rs.p, rs.q, |g| match g.num {
            1 => head_field(b, g, checks.map(|c| c.0), &mut head),
            3 => head_field(b, g, url, &mut head),
            2 => {
                want(g, LEN)?;
                let si = u32::try_from(self.scope_heads.len()).ok()?;
                let mut shead = Vec::new();
                fields(b, g.p, g.q, |h| match h.num {
                    1 => head_field(b, h, checks.map(|c| c.1), &mut shead),
                    3 => head_field(b, h, url, &mut shead),
                    2 => want(h, LEN).and_then(|_| item(si, h)),
                    _ => None,
                })?;
                self.scope_heads.push(shead);
                self.scope_resource.push(ri);
                Some(())
            }
            _ => None,
        })?;
        self.resource_heads.push(head);
        Some(())
    }
}

/// A resource's or scope's own field, kept whole for the split, and checked by `check`
/// when given.
fn head_field(b: &[u8], f: &Field, check: Option<Check>, head: &mut Vec<(usize, usize)>)
              -> Option<()> {
    want(f, LEN)?;
    if let Some(check) = check {
        check(b, f)?;
    }
    head.push((f.start, f.q));
    Some(())
}

/// The whole request checked (`deep`), or only as far as the split needs (a request
/// checked before): its spans and heads, or None.
fn walk(b: &[u8], deep: bool) -> Option<Request> {
    let mut req = Request::default();
    let checks: Option<(Check, Check)> = if deep { Some((resource, scope)) } else { None };
    let spans = &mut req.spans;
    fields(b, 0, b.len(), |rs| {
        if rs.num != 1 {
            return None;
        }
        req.nest.resource(b, rs, checks, |si, h| {
            let tid = if deep { span(b, h)? } else { span_trace_id(b, h)? };
            spans.push((si, h.start, h.q, tid));
            Some(())
        })
    })?;
    Some(req)
}

fn fnv1a_32(key: &[u8]) -> u32 {
    let mut h: u32 = 0x811C_9DC5;
    for &x in key {
        h = (h ^ u32::from(x)).wrapping_mul(0x0100_0193);
    }
    h
}

fn murmur2(key: &[u8]) -> u32 {
    const M: u32 = 0x5BD1_E995;
    let n = key.len();
    let mut h: u32 = 0x9747_B28C ^ (n as u32);
    let mut chunks = key.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]).wrapping_mul(M);
        k ^= k >> 24;
        h = h.wrapping_mul(M) ^ k.wrapping_mul(M);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (j, &x) in tail.iter().enumerate().rev() {
            h ^= u32::from(x) << (8 * j);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

fn hex16(id: &[u8]) -> [u8; 32] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (j, &x) in id.iter().take(16).enumerate() {
        out[2 * j] = DIGITS[usize::from(x >> 4)];
        out[2 * j + 1] = DIGITS[usize::from(x & 15)];
    }
    out
}

/// How a trace id's message is chosen: one message per trace, or per partition of the
/// id's hex key (`pipeline/kafka`'s partitioners).
#[derive(Clone, Copy)]
pub(crate) enum Keying {
    Trace,
    Sarama(u32),
    Murmur2(u32),
}

pub(crate) fn partition(keying: Keying, tid: &[u8]) -> u32 {
    let key = hex16(tid);
    match keying {
        Keying::Trace => 0,
        // the hash as int32, Go's truncating remainder made non-negative
        Keying::Sarama(n) => ((fnv1a_32(&key) as i32).unsigned_abs()) % n,
        Keying::Murmur2(n) => (murmur2(&key) & 0x7FFF_FFFF) % n,
    }
}

pub(crate) fn put_header(out: &mut Vec<u8>, field: u32, size: usize) {
    for mut v in [u64::from(field << 3 | u32::from(LEN)), size as u64] {
        while v >= 0x80 {
            out.push((v as u8 & 0x7F) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
}

pub(crate) fn ranges_len(r: &[(usize, usize)]) -> usize {
    r.iter().map(|(a, z)| z - a).sum()
}

pub(crate) fn header_len(field: u32, size: usize) -> usize {
    varint_len(u64::from(field << 3 | 2)) + varint_len(size as u64)
}

/// The messages of a checked request: (trace id offset of the key, start, end) in `buf`.
/// The same bytes as `pipeline/otlp/wire.py`'s `split_trace_bytes` (keys ordered by their
/// first span; in each, its resources and scopes in request order, each with its own
/// fields, then its spans in order).
fn split(b: &[u8], req: &Request, keying: Keying, limit: usize, buf: &mut Vec<u8>,
         idx: &mut Vec<u64>) -> Result<(), Refused> {
    // each span's group: its trace's, or its trace's partition's, numbered in order of
    // first appearance; a group's key is the trace id of its first span
    let mut by_trace: HashMap<[u8; 16], u32> = HashMap::new();
    let mut groups = Groups::new(keying);
    let mut group_of: Vec<u32> = Vec::with_capacity(req.spans.len());
    for &(_, _, _, t) in &req.spans {
        let tid: [u8; 16] = b[t..t + 16].try_into().unwrap_or([0; 16]);
        let g = match by_trace.get(&tid) {
            Some(&g) => g,
            None => {
                let g = groups.of_trace(&tid, t as u64);
                by_trace.insert(tid, g);
                g
            }
        };
        group_of.push(g);
    }
    let group_key = &groups.key;
    let groups = group_key.len();
    let (first, order) = order_by_group(&group_of, groups);
    let (mut scopes, mut resources) = (Vec::new(), Vec::new());
    for g in 0..groups {
        let spans = &order[first[g]..first[g + 1]];
        let span = |s: u32| req.spans[s as usize];
        // runs of one scope, then of one resource, with their messages' sizes
        runs(spans, |s| span(s).0, |sc| ranges_len(&req.nest.scope_heads[sc as usize]),
             |s| span(s).2 - span(s).1, &mut scopes);
        outer_runs(&scopes, &req.nest.scope_resource, &req.nest.resource_heads, &mut resources);
        let size: usize = resources.iter().map(|r| header_len(1, r.size) + r.size).sum();
        if buf.len() + size > limit {
            return Err(Refused::TooLarge); // resource and scope fields repeated too often
        }
        let msg_start = buf.len();
        req.nest.put(buf, b, &resources, &scopes, |buf, sc| {
            copy_runs(buf, b, &spans[sc.from..sc.to], |s| (span(s).1, span(s).2));
        });
        idx.extend_from_slice(&[group_key[g], msg_start as u64, buf.len() as u64]);
    }
    Ok(())
}

/// Consecutive items of one parent (`key`): the parent's message covers `from..to` of
/// the items and is `size` bytes (its own fields, then each item).
pub(crate) struct Run {
    pub(crate) key: u32,
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) size: usize,
}

/// `items` cut into runs of one parent (`key_of`), each sized as its head (`head`) and
/// its items (`size_of`, header included), into `out`.
pub(crate) fn runs(items: &[u32], key_of: impl Fn(u32) -> u32, head: impl Fn(u32) -> usize,
                   size_of: impl Fn(u32) -> usize, out: &mut Vec<Run>) {
    out.clear();
    let mut k = 0;
    while k < items.len() {
        let key = key_of(items[k]);
        let from = k;
        let mut size = head(key);
        while k < items.len() && key_of(items[k]) == key {
            size += size_of(items[k]);
            k += 1;
        }
        out.push(Run { key, from, to: k, size });
    }
}

/// Runs of `inner` runs under one parent (`parent[inner key]`), sized with their headers
/// and each parent's own fields (`heads`).
pub(crate) fn outer_runs(inner: &[Run], parent: &[u32], heads: &[Vec<(usize, usize)>],
                         out: &mut Vec<Run>) {
    let ids: Vec<u32> = (0..inner.len() as u32).collect();
    runs(&ids, |r| parent[inner[r as usize].key as usize],
         |p| ranges_len(&heads[p as usize]),
         |r| header_len(2, inner[r as usize].size) + inner[r as usize].size, out);
}

/// Byte ranges of `b` given in order, adjacent ones copied as one.
pub(crate) fn copy_runs(buf: &mut Vec<u8>, b: &[u8], items: &[u32],
                        bounds: impl Fn(u32) -> (usize, usize)) {
    let mut j = 0;
    while j < items.len() {
        let (a, mut z) = bounds(items[j]);
        j += 1;
        while j < items.len() && bounds(items[j]).0 == z {
            z = bounds(items[j]).1;
            j += 1;
        }
        buf.extend_from_slice(&b[a..z]);
    }
}

pub(crate) fn copy(buf: &mut Vec<u8>, b: &[u8], ranges: &[(usize, usize)]) {
    for &(a, z) in ranges {
        buf.extend_from_slice(&b[a..z]);
    }
}

/// Messages numbered in order of first appearance: one per trace, or per partition of
/// the traces' hex keys; `key[g]` says where message g's key is (the trace id of its
/// first item, or u64::MAX for a message of items without a trace).
pub(crate) struct Groups {
    keying: Keying,
    by_partition: HashMap<u32, u32>,
    pub(crate) key: Vec<u64>,
}

impl Groups {
    pub(crate) fn new(keying: Keying) -> Self {
        Groups { keying, by_partition: HashMap::new(), key: Vec::new() }
    }

    /// The message of a trace not seen before (`tid`, at offset `at` of the request).
    pub(crate) fn of_trace(&mut self, tid: &[u8], at: u64) -> u32 {
        let next = self.key.len() as u32;
        let g = match self.keying {
            Keying::Trace => next,
            k => *self.by_partition.entry(partition(k, tid)).or_insert(next),
        };
        if g == next {
            self.key.push(at);
        }
        g
    }

    /// A message of its own (keyed `key`).
    pub(crate) fn add(&mut self, key: u64) -> u32 {
        self.key.push(key);
        self.key.len() as u32 - 1
    }
}

/// The items of each group in their order (a counting sort): `order[first[g]..first[g +
/// 1]]` are group g's item numbers.
pub(crate) fn order_by_group(group_of: &[u32], groups: usize) -> (Vec<usize>, Vec<u32>) {
    let mut first = vec![0usize; groups + 1];
    for &g in group_of {
        first[g as usize + 1] += 1;
    }
    for g in 0..groups {
        first[g + 1] += first[g];
    }
    let mut fill = first.clone();
    let mut order = vec![0u32; group_of.len()];
    for (s, &g) in group_of.iter().enumerate() {
        order[fill[g as usize]] = s as u32;
        fill[g as usize] += 1;
    }
    (first, order)
}

/// Why a split was not made here.
pub(crate) enum Refused {
    /// The Python path decides (something unexpected).
    Unsure,
    /// The parts' copies of the dictionary would outweigh the request: compact instead.
    TooLarge,
}

type Splitter = fn(&[u8], Keying, usize, &mut Vec<u8>, &mut Vec<u64>) -> Result<(), Refused>;

/// A split behind the C boundary (messages of at most `limit` bytes in all): the number of
/// messages, with `out` filled; -1 when the Python path must do it, -2 for
/// `Refused::TooLarge`.
unsafe fn split_at_boundary(data: *const u8, len: usize, hasher: u32, partitions: u32,
                            limit: usize, out: *mut Out, splitter: Splitter) -> i64 {
    let b = input(data, len);
    let keying = match keying(hasher, partitions) {
        Some(k) if !out.is_null() => k,
        _ => return -1,
    };
    let done = catch_unwind(AssertUnwindSafe(|| {
        let mut buf = Vec::with_capacity(b.len() + 64);
        let mut idx = Vec::new();
        splitter(b, keying, limit, &mut buf, &mut idx).map(|_| (buf, idx))
    }));
    match done {
        Ok(Ok((buf, idx))) => hand_out(buf, idx, out),
        Ok(Err(Refused::TooLarge)) => -2,
        _ => -1,
    }
}

fn split_traces(b: &[u8], keying: Keying, limit: usize, buf: &mut Vec<u8>,
                idx: &mut Vec<u64>) -> Result<(), Refused> {
    let req = walk(b, false).ok_or(Refused::Unsure)?;
    split(b, &req, keying, limit, buf, idx)
}

/// Vectors handed to the caller, given back to `spanprof_out_free`.
#[repr(C)]
pub struct Out {
    pub buf: *mut u8,
    pub buf_len: usize,
    pub buf_cap: usize,
    pub idx: *mut u64,
    pub idx_len: usize,
    pub idx_cap: usize,
}

unsafe fn input<'a>(data: *const u8, len: usize) -> &'a [u8] {
    if data.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller passes a buffer it keeps alive for the call
        std::slice::from_raw_parts(data, len)
    }
}

/// The number of spans of an ExportTraceServiceRequest whose spans all pass the
/// gateway's checks; -1 when the Python path must decide.
///
/// # Safety
/// `data` points to `len` readable bytes for the duration of the call.
#[no_mangle]
pub unsafe extern "C" fn spanprof_traces_check(data: *const u8, len: usize) -> i64 {
    let b = input(data, len);
    catch_unwind(|| walk(b, true).map_or(-1, |r| r.spans.len() as i64)).unwrap_or(-1)
}

/// A request checked before (by `spanprof_traces_check`, or parsed by upb and checked by
/// the Python path) split by trace (`hasher` 0), or by the partition (of `partitions`) of
/// each trace id's hex key: 1 sarama_compat, 2 murmur2. Only the structure the split
/// needs is read again, bounds checked as everywhere. Returns the number of messages
/// and fills `out` (free it with `spanprof_out_free`), or (nothing allocated) -1 when the
/// Python path must do it, -2 when the messages would make more than `limit` bytes.
///
/// # Safety
/// `data` points to `len` readable bytes for the duration of the call; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn spanprof_traces_split(data: *const u8, len: usize, hasher: u32,
                                               partitions: u32, limit: usize, out: *mut Out)
                                               -> i64 {
    split_at_boundary(data, len, hasher, partitions, limit, out, split_traces)
}

fn keying(hasher: u32, partitions: u32) -> Option<Keying> {
    match (hasher, partitions) {
        (0, _) => Some(Keying::Trace),
        (1, n) if n > 0 => Some(Keying::Sarama(n)),
        (2, n) if n > 0 => Some(Keying::Murmur2(n)),
        _ => None,
    }
}

/// Hands `buf` and `idx` to the caller through `out`: the number of parts.
unsafe fn hand_out(buf: Vec<u8>, idx: Vec<u64>, out: *mut Out) -> i64 {
    let n = (idx.len() / 3) as i64;
    let mut buf = std::mem::ManuallyDrop::new(buf);
    let mut idx = std::mem::ManuallyDrop::new(idx);
    *out = Out {
        buf: buf.as_mut_ptr(),
        buf_len: buf.len(),
        buf_cap: buf.capacity(),
        idx: idx.as_mut_ptr(),
        idx_len: idx.len(),
        idx_cap: idx.capacity(),
    };
    n
}

/// A checked ExportProfilesServiceRequest split by the partition of each sample's trace
/// (`profiles.rs`): the number of parts, filling `out` (free it with `spanprof_out_free`;
/// a part's key offset is u64::MAX for the samples without a trace); -1 when the Python
/// path must do it, -2 when the parts' dictionaries would outweigh the request (compact).
///
/// # Safety
/// `data` points to `len` readable bytes for the duration of the call; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn spanprof_profiles_split(data: *const u8, len: usize, hasher: u32,
                                                 partitions: u32, out: *mut Out) -> i64 {
    split_at_boundary(data, len, hasher, partitions, usize::MAX, out, profiles::split)
}

/// The samples of an ExportProfilesServiceRequest upb parsed, as columns
/// (`profiles::columns`) in `out`'s `idx` (free it with `spanprof_out_free`): the number of
/// profiles, or -1 when the Python path reads them.
///
/// # Safety
/// `data` points to `len` readable bytes for the duration of the call; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn spanprof_profiles_columns(data: *const u8, len: usize,
                                                   out: *mut Out) -> i64 {
    let b = input(data, len);
    if out.is_null() {
        return -1;
    }
    match catch_unwind(|| profiles::columns(b)) {
        Ok(Some(cols)) => {
            let profiles = cols[0] as i64;
            hand_out(Vec::new(), cols, out);
            profiles
        }
        _ => -1,
    }
}

/// Every entry of an ExportProfilesServiceRequest's dictionary checked
/// (`profiles::dictionary`): 0 and `out` = [strings, links, stacks, depth, excess, text],
/// or -1 when the Python path checks the entries the profiles use.
///
/// # Safety
/// `data` points to `len` readable bytes for the duration of the call; `out` points to
/// six writable u64.
#[no_mangle]
pub unsafe extern "C" fn spanprof_profiles_dictionary(data: *const u8, len: usize, fanout: u64,
                                                      out: *mut u64) -> i64 {
    let b = input(data, len);
    if out.is_null() {
        return -1;
    }
    match catch_unwind(|| profiles::dictionary(b, fanout)) {
        Ok(Some(s)) => {
            let got = [s.strings, s.links, s.stacks, s.depth, s.excess, s.text];
            std::ptr::copy_nonoverlapping(got.as_ptr(), out, got.len());
            0
        }
        _ => -1,
    }
}

/// Gives back what `spanprof_traces_split`, `spanprof_profiles_split` or
/// `spanprof_profiles_columns` handed out.
///
/// # Safety
/// `out` was filled by `spanprof_traces_split` and not freed since.
#[no_mangle]
pub unsafe extern "C" fn spanprof_out_free(out: *mut Out) {
    if out.is_null() {
        return;
    }
    let o = &mut *out;
    if !o.buf.is_null() {
        drop(Vec::from_raw_parts(o.buf, o.buf_len, o.buf_cap));
    }
    if !o.idx.is_null() {
        drop(Vec::from_raw_parts(o.idx, o.idx_len, o.idx_cap));
    }
    o.buf = std::ptr::null_mut();
    o.idx = std::ptr::null_mut();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_sizes() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(u64::MAX), 10);
    }

    #[test]
    fn hashes_match_the_python_ones() {
        // values from pipeline/kafka's scalar functions
        assert_eq!(fnv1a_32(b""), 0x811C_9DC5);
        assert_eq!(fnv1a_32(b"a"), 0xE40C_292C);
    }

    #[test]
    fn refuses_truncated_input() {
        for deep in [true, false] {
            assert!(walk(&[0x0A, 0x05, 0x12], deep).is_none());
            assert!(walk(&[0x0A], deep).is_none());
            assert!(walk(&[], deep).map(|r| r.spans.len()) == Some(0));
        }
    }
}
