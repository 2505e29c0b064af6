/* One routing decision in C: Router.route with the prefix_aware policy at temperature 0
 * (router.py, policy.py, cost.py), the same arithmetic in the same order, so the same worker,
 * cost and hit counts as the Python path (tests/unit/test_router_decider.py compares them):
 *
 *   optimistic additions that lapsed are dropped (Router._expire); the prompt's deepest in-flight
 *   block is found (InFlightPrefixes.match) and the index walked (PrefixIndex.match), the in-flight
 *   blocks counted beyond that worker's indexed prefix (with_in_flight); the decode node is the
 *   cheapest by decode_node_cost; it prefills locally when should_prefill_locally says so, else
 *   the prefill node is the cheapest by prefill_cost, ties from _tie_start (tie_start); colocated: one node by
 *   prefill_cost + decode_cost. Then the chosen nodes' optimistic additions (Router._account) and
 *   the prompt recorded as in flight to the node prefilling it, and the records built. */
#include "decider.h"

static void expire(Decider *d, double now) {
    int has = 0; double nxt = 0;
    for (Py_ssize_t i = 0; i < d->nslots; i++) {
        WSlot *s = &d->slots[i];
        if (!s->id || !s->has_until) continue;
        if (s->until <= now) { s->pend_tokens = s->pend_running = 0; s->has_until = 0; }
        else if (!has || s->until < nxt) { nxt = s->until; has = 1; }
    }
    d->has_next = has; d->next_expiry = nxt;
}

static const Match NO_MATCH = {0, 0, 0, 0};

static inline const Match *match_of(const Decider *d, const WSlot *s) {
    return s->stamp == d->stamp ? &s->m : &NO_MATCH;
}

static inline Py_ssize_t blocks_of(const Match *m) { return m->dev + m->host + m->disk + m->inf; }

/* Each slot's leading prompt blocks: the index walk, then the in-flight node's extension. */
static void find_matches(Decider *d, const Keys *K, int32_t flight, Py_ssize_t depth) {
    Walk w;
    d->stamp++;
    bt_walk_keys(d->blocks, K, &w);
    for (uint64_t g = w.first; g; g &= g - 1) {
        int b = __builtin_ctzll(g);
        if (d->bit_slot[b] < 0) continue;
        WSlot *s = &d->slots[d->bit_slot[b]];
        s->m = (Match){w.length[b] - w.host[b] - w.disk[b], w.host[b], w.disk[b], 0};
        s->stamp = d->stamp;
    }
    if (flight < 0 || flight >= d->nflight || d->flight_slot[flight] < 0) return;
    WSlot *s = &d->slots[d->flight_slot[flight]];
    if (s->stamp != d->stamp) { s->m = NO_MATCH; s->stamp = d->stamp; }
    Py_ssize_t extra = depth - blocks_of(&s->m);
    if (extra > 0) s->m.inf += extra;
}

/* cost.effective_cached_blocks: a host, disk or in-flight hit weighs less than a device hit. */
static inline double effective_blocks(const double *w, const Match *m) {
    return (double)m->dev + w[W_HOST] * (double)m->host + w[W_DISK] * (double)m->disk + w[W_IN_FLIGHT] * (double)m->inf;
}

/* policy._prefill_costs for one worker (cost.prefill_cost of its uncached blocks and queue), a miss
 * weighing wu (W_UNCACHED, or cost.busy_weights' on a pool busy everywhere); a match under
 * min_hit (blocks; policy._long_hits: W_MIN_HIT_SHARE of the prompt, 0: off) counts as none. */
static double prefill_cost(const Decider *d, const WSlot *s, double total, long long bs, double wu, double min_hit) {
    const double *w = d->w;
    const Match *m = match_of(d, s);
    if (min_hit > 0 && effective_blocks(w, m) < min_hit) m = &NO_MATCH;
    long long q = eff_queued(s);
    double uncached;
    if (m->host || m->disk || m->inf) {
        uncached = total - effective_blocks(w, m);
        if (m->inf) q -= m->inf * bs;
    } else {
        uncached = total - (double)m->dev;
    }
    return wu * uncached * (double)bs + w[W_QUEUED] * (double)(q > 0 ? q : 0);
}

/* cost.decode_node_cost: batch, KV usage, queue, and the blocks the node must pull. */
static double decode_cost(const Decider *d, const WSlot *s, Py_ssize_t n_full) {
    const double *w = d->w;
    return w[W_RUNNING] * (double)eff_running(s) + w[W_KV] * s->kv + w[W_QUEUED] * (double)eff_queued(s)
           + w[W_TRANSFER] * (double)(n_full - blocks_of(match_of(d, s)));
}

/* cost.select at temperature 0: the first minimum at or after start, wrapping round. */
static Py_ssize_t select_min(const double *c, Py_ssize_t n, Py_ssize_t start) {
    Py_ssize_t best = 0;
    for (Py_ssize_t i = 1; i < n; i++) if (c[i] < c[best]) best = i;
    if (start > 0 && start < n)
        for (Py_ssize_t i = start; i < n; i++) if (c[i] == c[best]) return i;
    return best;
}

/* policy._tie_start: the hash of the prompt's first block not every prefill node holds (the last
 * when they all hold it all; without blocks, the key passed in), modulo the pool. */
static Py_ssize_t tie_start(const Decider *d, const Keys *K, uint64_t tie, Py_ssize_t np) {
    if (np <= 1) return 0;
    if (K->n) {
        Py_ssize_t shared = K->n - 1;
        for (Py_ssize_t i = 0; i < np && shared > 0; i++) {
            Py_ssize_t b = blocks_of(match_of(d, &d->slots[d->role[PREFILL][i]]));
            if (b < shared) shared = b;
        }
        tie = K->keys[shared];
    }
    return (Py_ssize_t)(tie % (uint64_t)np);
}

/* policy.least_assigned: the cheapest; among equal costs the fewest tokens assigned, then the
 * first at or after start, wrapping round. */
static Py_ssize_t select_least_assigned(const Decider *d, const double *c, Py_ssize_t n, Py_ssize_t start) {
    Py_ssize_t best = start;
    for (Py_ssize_t k = 1; k < n; k++) {
        Py_ssize_t i = (start + k) % n;
        if (c[i] < c[best] || (c[i] == c[best] && d->slots[d->role[PREFILL][i]].assigned
                                                  < d->slots[d->role[PREFILL][best]].assigned))
            best = i;
    }
    return best;
}

typedef struct { Py_ssize_t pos; double cost; WSlot *s; } Pick;

static Pick pick(Decider *d, int role, double *c, Py_ssize_t start) {
    Py_ssize_t i = select_min(c, d->nrole[role], start);
    return (Pick){i, c[i], &d->slots[d->role[role][i]]};
}

static Pick pick_decode(Decider *d, double *c, Py_ssize_t n_full) {
    for (Py_ssize_t i = 0; i < d->nrole[DECODE]; i++) c[i] = decode_cost(d, &d->slots[d->role[DECODE][i]], n_full);
    return pick(d, DECODE, c, 0);
}

/* cost.busy_pool: every node of the prefill pool has tokens queued. */
static int busy_pool(const Decider *d) {
    for (Py_ssize_t i = 0; i < d->nrole[PREFILL]; i++)
        if (eff_queued(&d->slots[d->role[PREFILL][i]]) <= 0) return 0;
    return 1;
}

/* The prefill pool's node (ties: select_least_assigned from start; a miss weighs busy_pool_miss x
 * more when every node has a queue; hits under min_hit_share of the prompt count as none);
 * colocated (role DECODE): prefill_cost + decode_cost, ties to the lowest index. */
static Pick pick_prefill(Decider *d, int role, double *c, long long prompt, long long bs, Py_ssize_t start) {
    Py_ssize_t n = d->nrole[role];
    double total = (double)prompt / (double)bs;
    double wu = role == PREFILL && busy_pool(d) ? d->w[W_UNCACHED] * d->w[W_BUSY_POOL] : d->w[W_UNCACHED];
    double min_hit = role == PREFILL ? d->w[W_MIN_HIT_SHARE] * (double)prompt / (double)bs : 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const WSlot *s = &d->slots[d->role[role][i]];
        c[i] = prefill_cost(d, s, total, bs, wu, min_hit);
        if (d->colocated) c[i] += d->w[W_RUNNING] * (double)eff_running(s) + d->w[W_KV] * s->kv;
    }
    if (role != PREFILL) return pick(d, role, c, start);
    Py_ssize_t i = select_least_assigned(d, c, n, start);
    return (Pick){i, c[i], &d->slots[d->role[PREFILL][i]]};
}

/* Router._account: the prefill node queues (and is assigned) the uncached tokens, the decode node
 * one more sequence. */
static void account(Decider *d, WSlot *p, WSlot *dec, long long tokens, double now) {
    double until = now + d->pending_ttl;
    p->pend_tokens += tokens;
    p->assigned += tokens;
    dec->pend_running += 1;
    if (!p->has_until) { p->until = until; p->has_until = 1; }
    if (!dec->has_until) { dec->until = until; dec->has_until = 1; }
    if (!d->has_next) { d->next_expiry = until; d->has_next = 1; }
}

static PyObject *inputs_of(Decider *d, const Pick *k, Py_ssize_t candidates) {
    const WSlot *s = k->s;
    return make_inputs(&d->rec, s->id, make_match(&d->rec, match_of(d, s)),
                       make_load(&d->rec, eff_queued(s), eff_running(s), s->waiting, s->kv), k->cost, candidates);
}

static PyObject *decision(Decider *d, PyObject *req_id, const Pick *dk, const Pick *pk, long long bs) {
    Records *r = &d->rec;
    long long d_cached = blocks_of(match_of(d, dk->s)) * bs;
    long long p_cached = pk ? blocks_of(match_of(d, pk->s)) * bs : d_cached;
    PyObject *v[9] = {Py_NewRef(req_id), Py_NewRef(r->policy), Py_NewRef(pk ? r->remote : r->local),
                      Py_NewRef(dk->s->id), Py_NewRef(pk ? pk->s->id : Py_None), PyLong_FromLongLong(p_cached),
                      PyLong_FromLongLong(d_cached), inputs_of(d, dk, d->nrole[DECODE]),
                      pk ? inputs_of(d, pk, d->nrole[PREFILL]) : Py_NewRef(Py_None)};
    return make_record(&r->decision, v);
}

/* Find the matches, pick the nodes, build the records (before the accounting changes the loads). */
typedef struct { WSlot *decode, *prefill; long long prefill_cached; } Chosen;

static PyObject *choose(Decider *d, const Keys *K, long long prompt, long long bs, PyObject *req_id,
                        uint64_t tie, Chosen *ch) {
    Py_ssize_t nd = d->nrole[DECODE], np = d->nrole[PREFILL], n = nd > np ? nd : np;
    double stack[128], *c = n <= 128 ? stack : PyMem_Malloc(n * sizeof(double));
    if (!c) return PyErr_NoMemory();
    PyObject *out;
    if (d->colocated) {
        Pick dk = pick_prefill(d, DECODE, c, prompt, bs, 0);
        *ch = (Chosen){dk.s, dk.s, blocks_of(match_of(d, dk.s)) * bs};
        out = decision(d, req_id, &dk, NULL, bs);
    } else {
        Pick dk = pick_decode(d, c, K->n);
        long long d_cached = blocks_of(match_of(d, dk.s)) * bs;
        if (prompt - d_cached <= d->threshold || (double)d_cached / (double)prompt >= d->hit_ratio || !np) {
            *ch = (Chosen){dk.s, dk.s, d_cached};
            out = decision(d, req_id, &dk, NULL, bs);
        } else {
            Pick pk = pick_prefill(d, PREFILL, c, prompt, bs, tie_start(d, K, tie, np));
            *ch = (Chosen){dk.s, pk.s, blocks_of(match_of(d, pk.s)) * bs};
            out = decision(d, req_id, &dk, &pk, bs);
        }
    }
    if (c != stack) PyMem_Free(c);
    return out;
}

static int expect_int(PyObject *o, long long *out, const char *what) {
    *out = PyLong_AsLongLong(o);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (*out <= 0) { PyErr_Format(PyExc_ValueError, "%s must be positive", what); return -1; }
    return 0;
}

/* The in-flight node and depth of the prompt (InFlightPrefixes.match: ageing first, not when empty). */
static int32_t flight_match(Decider *d, const Keys *K, double now, Py_ssize_t *depth) {
    *depth = 0;
    if (!d->flight || !K->n || ft_is_empty(d->flight)) return -1;
    if (ft_age(d->flight, now, d->flight_ttl) < 0) return -2;
    return ft_match_keys(d->flight, K, now, d->epochs, depth);
}

/* InFlightPrefixes.record: the prompt was sent to slot s. */
static int flight_record(Decider *d, const Keys *K, const WSlot *s, double now) {
    if (!d->flight || !K->n) return 0;
    if (s->flight < 0 || s->flight >= PyList_GET_SIZE(d->epochs)) {
        PyErr_SetString(PyExc_RuntimeError, "a routed worker has no in-flight number: register it with add()");
        return -1;
    }
    uint32_t epoch = (uint32_t)PyLong_AsUnsignedLongMask(PyList_GET_ITEM(d->epochs, s->flight));
    if (ft_age(d->flight, now, d->flight_ttl) < 0) return -1;
    return ft_record_keys(d->flight, K, s->flight, epoch, now + d->flight_ttl);
}

/* decide(hashes, prompt_tokens, block_size, request_id, tie_key, now) -> RoutingDecision, or None
 * when no decode worker is live. OverflowError, before any change, for a hash that is not a
 * 64-bit unsigned int (the Python path serves then). tie_key: the prefill tie start's key when
 * there are no hashes (the request id's CRC); with hashes, tie_start picks one of them. */
PyObject *decider_decide(Decider *d, PyObject *const *args, Py_ssize_t nargs) {
    long long prompt, bs;
    uint64_t tie;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "decide takes 6 arguments"); return NULL; }
    double now = PyFloat_AsDouble(args[5]);
    if ((now == -1.0 && PyErr_Occurred()) || expect_int(args[1], &prompt, "prompt_tokens") < 0 ||
        expect_int(args[2], &bs, "block_size") < 0 || to_key(args[4], &tie) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "block hashes must be a sequence"), *out = NULL;
    if (!seq) return NULL;
    Keys K;
    if (keys_load(&K, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)) < 0) { Py_DECREF(seq); return NULL; }
    if (K.bad) { PyErr_SetString(PyExc_OverflowError, "block hashes must be 64-bit unsigned ints"); goto done; }
    if (d->has_next && now >= d->next_expiry) expire(d, now);
    Py_ssize_t depth;
    int32_t flight = flight_match(d, &K, now, &depth);
    if (flight == -2) goto done;
    if (!d->nrole[DECODE]) { out = Py_NewRef(Py_None); goto done; }
    find_matches(d, &K, flight, depth);
    Chosen ch = {NULL, NULL, 0};
    out = choose(d, &K, prompt, bs, args[3], tie, &ch);
    if (!out) goto done;
    account(d, ch.prefill, ch.decode, prompt - ch.prefill_cached, now);
    if (flight_record(d, &K, ch.prefill, now) < 0) Py_CLEAR(out);
done:
    keys_free(&K);
    Py_DECREF(seq);
    return out;
}
