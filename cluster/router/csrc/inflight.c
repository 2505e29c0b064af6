/* InFlightTable: InFlightPrefixes' two generations (hash -> worker, epoch, expiry) as two flat
 * tables, and their ageing (InFlightPrefixes._age: the generation's start lives here). */
#include "routerfast.h"

static void fslots_init(void *mem, size_t bytes) {
    FSlot *s = mem;
    for (size_t i = 0; i < bytes / sizeof(FSlot); i++) s[i].worker = -1;
}

static int fg_alloc(FGen *g, uint64_t cap) {
    FSlot *s = PyMem_RawMalloc(cap * sizeof(FSlot));
    if (!s) { PyErr_NoMemory(); return -1; }
    want_huge_pages(s, cap * sizeof(FSlot));
    fslots_init(s, cap * sizeof(FSlot));
    g->slots = s; g->mask = cap - 1; g->count = 0;
    return 0;
}

#define F_EMPTY(s) ((s)->worker == -1)
#define F_TOMB(s) ((s)->worker == -2)           /* only in a doubling's delta: removed from cur */
#define F_CLEAR(s) ((s)->worker = -1)
OPEN_ADDRESSING(fg, FGen, FSlot, F_EMPTY, F_CLEAR)

/* fg_find and fg_place's probe in one run: the slot holding k, else the first empty one from its
 * home (where fg_place would put it; writing one there is the caller's, count included). */
static inline FSlot *fg_slot(const FGen *g, uint64_t k) {
    for (uint64_t i = mix(k) & g->mask;; i = (i + 1) & g->mask) {
        FSlot *s = &g->slots[i];
        if (F_EMPTY(s) || s->key == k) return s;
    }
}

static PyObject *ft_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    InFlightTable *t = (InFlightTable *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    if (fg_alloc(&t->cur, 1u << MIN_BITS) < 0) { Py_DECREF(t); return NULL; }
    if (fg_alloc(&t->prev, 1u << MIN_BITS) < 0) { Py_DECREF(t); return NULL; }
    return (PyObject *)t;
}

static void ft_abandon(InFlightTable *t);

static void ft_dealloc(InFlightTable *t) {
    ft_abandon(t);
    prep_drop(&t->next);
    prep_drop(&t->fresh);
    PyMem_RawFree(t->cur.slots);
    PyMem_RawFree(t->prev.slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* ---- A doubling of cur off the routing thread.
 *
 * Doubling cur in the call that fills it rehashed up to 2 M entries there (2-18 ms, in the first
 * generation of a busy router, before ft_prepare_fresh sizes one). Instead, once cur is half full
 * (and at least 2**PREP_MIN_BITS slots), a helper thread places cur's entries into the doubled
 * array (made ready by ft_prepare) while the router goes on: cur is read-only meanwhile, so the
 * helper reads nothing the router writes. The router's writes go to a small ``delta`` table that
 * answers before cur (a removal there is a tombstone, which hides cur's entry only); the first
 * write after the helper is done lays delta over the doubled array and makes it cur. */

#define DOUBLING_CHUNK 32768     /* slots placed between looks at the stop flag */

static void ft_prepare(InFlightTable *t);

static void *doubling_run(void *arg) {
    Doubling *d = arg;
    const FGen *from = &d->from;
    FGen *to = &d->to;
    uint64_t cap = from->mask + 1;
    size_t bytes = (to->mask + 1) * sizeof(FSlot);
    if (d->need_init) { want_huge_pages(to->slots, bytes); fslots_init(to->slots, bytes); }
    for (uint64_t i = 0; i < cap; i++) {                    /* home slots prefetched ahead: misses overlap */
        const FSlot *a = &from->slots[(i + PREFETCH_AHEAD) & (cap - 1)];
        if (!F_EMPTY(a)) __builtin_prefetch(&to->slots[mix(a->key) & to->mask], 1);
        if (!F_EMPTY(&from->slots[i])) fg_place(to, &from->slots[i]);
        if ((i & (DOUBLING_CHUNK - 1)) == DOUBLING_CHUNK - 1 && __atomic_load_n(&d->stop, __ATOMIC_ACQUIRE)) break;
    }
    __atomic_store_n(&d->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* Starts doubling cur into the array made ready for it (else a new one the helper readies first).
 * 1: started; 0: not (cur is small, or no memory: the caller doubles in place). */
static int ft_start_doubling(InFlightTable *t) {
    FGen *g = &t->cur;
    uint64_t cap = g->mask + 1;
    if (cap < ((uint64_t)1 << PREP_MIN_BITS)) return 0;
    Doubling *d = &t->dbl;
    FSlot *s = prep_take(&t->next, 2 * cap * sizeof(FSlot));
    d->need_init = !s;
    if (!s && !(s = PyMem_RawMalloc(2 * cap * sizeof(FSlot)))) return 0;
    if (fg_alloc(&d->delta, 1u << MIN_BITS) < 0) { PyErr_Clear(); PyMem_RawFree(s); return 0; }
    d->from = *g;
    d->to = (FGen){s, 2 * cap - 1, 0};
    d->done = d->stop = 0;
    d->running = 1;
    d->threaded = pthread_create(&d->thread, NULL, doubling_run, d) == 0;
    if (!d->threaded) doubling_run(d);             /* no thread: done here, as before */
    return 1;
}

/* delta's writes applied to g (its tombstones as removals). */
static void delta_apply(FGen *g, const FGen *dl) {
    for (uint64_t i = 0; i <= dl->mask; i++) {                /* g's home slots prefetched ahead */
        const FSlot *a = &dl->slots[(i + PREFETCH_AHEAD) & dl->mask], *v = &dl->slots[i];
        if (!F_EMPTY(a)) __builtin_prefetch(&g->slots[mix(a->key) & g->mask], 1);
        if (F_EMPTY(v)) continue;
        FSlot *s = fg_slot(g, v->key);
        if (F_TOMB(v)) { if (!F_EMPTY(s)) fg_remove(g, s); continue; }
        if (F_EMPTY(s)) g->count++;
        *s = *v;
    }
}

/* Ends a doubling under way (waiting for the helper if it is not done): delta laid over the
 * doubled array, which becomes cur. Allocates nothing: the array has room (cur was at most half
 * of its half, delta is kept under a quarter). */
static void ft_settle(InFlightTable *t) {
    Doubling *d = &t->dbl;
    if (!d->running) return;
    if (d->threaded) pthread_join(d->thread, NULL);
    delta_apply(&d->to, &d->delta);
    PyMem_RawFree(d->from.slots);
    PyMem_RawFree(d->delta.slots);
    t->cur = d->to;
    memset(d, 0, sizeof *d);
    ft_prepare(t);                                 /* the array the next doubling takes */
}

/* Drops a doubling under way without waiting for it (a new generation, the table's end): the
 * helper stops at its next chunk, delta is laid over cur itself (then up to 3/4 full: read only
 * from now on, as the previous generation). */
static void ft_abandon(InFlightTable *t) {
    Doubling *d = &t->dbl;
    if (!d->running) return;
    __atomic_store_n(&d->stop, 1, __ATOMIC_RELEASE);
    if (d->threaded) pthread_join(d->thread, NULL);
    delta_apply(&t->cur, &d->delta);
    PyMem_RawFree(d->to.slots);
    PyMem_RawFree(d->delta.slots);
    memset(d, 0, sizeof *d);
}

/* Before writing n entries: room in the table they go to (fg_slot's empty slot stays valid
 * through the write). A doubling whose helper is done is settled first; delta grows in place. */
static int ft_room(InFlightTable *t, Py_ssize_t n) {
    Doubling *d = &t->dbl;
    if (d->running) {
        uint64_t cap = t->cur.mask + 1;
        if (__atomic_load_n(&d->done, __ATOMIC_ACQUIRE) || (uint64_t)(d->delta.count + n) * 4 > cap)
            ft_settle(t);
    }
    for (;;) {
        FGen *g = d->running ? &d->delta : &t->cur;
        /* At most half full after this write: a probe for a new hash (most of a prompt's) runs to
         * the first empty slot, 2.5 slots on average at a half against 8.5 at 0.75 (linear probing). */
        if ((uint64_t)(g->count + n) * 2 <= g->mask + 1) return 0;
        if ((d->running || !ft_start_doubling(t)) && fg_grow(g) < 0) return -1;   /* delta, or a small cur */
    }
}

/* The table writes go to: a doubling's delta, else cur. */
static FGen *ft_target(InFlightTable *t) { return t->dbl.running ? &t->dbl.delta : &t->cur; }

/* cur's entry for k (NULL: none), a doubling's delta first (its tombstone: none). */
static const FSlot *ft_cur_find(const InFlightTable *t, uint64_t k) {
    if (t->dbl.running) {
        const FSlot *v = fg_find(&t->dbl.delta, k);
        if (v) return F_TOMB(v) ? NULL : v;
    }
    return fg_find(&t->cur, k);
}

/* Past a quarter full (half-way to a doubling) a big cur's next array is made ready; one of
 * another size (cur started afresh at a new generation) is dropped first. */
static void ft_prepare(InFlightTable *t) {
    const FGen *g = &t->cur;
    uint64_t cap = g->mask + 1;
    size_t bytes = 2 * cap * sizeof(FSlot);
    if (t->dbl.running || cap < ((uint64_t)1 << PREP_MIN_BITS) || (uint64_t)g->count * 4 <= cap
        || t->next.bytes == bytes) return;
    prep_drop(&t->next);
    prep_start(&t->next, bytes, fslots_init);
}

int ft_record_keys(InFlightTable *t, const Keys *K, int32_t worker, uint32_t epoch, double expiry) {
    const uint64_t *keys = K->keys; Py_ssize_t n = K->n;
    if (K->bad) { PyErr_SetString(PyExc_OverflowError, "block hashes must be 64-bit unsigned ints"); return -1; }
    if (ft_room(t, n) < 0) return -1;
    FGen *g = ft_target(t);
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) __builtin_prefetch(&g->slots[mix(keys[i]) & g->mask], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&g->slots[mix(keys[i + PREFETCH_AHEAD]) & g->mask], 1);
        FSlot *s = fg_slot(g, keys[i]);
        if (F_EMPTY(s)) g->count++;
        *s = (FSlot){keys[i], expiry, worker, epoch};
    }
    ft_prepare(t);
    return 0;
}

/* record(hashes, worker, epoch, expiry): the current generation maps each hash to this send. */
static PyObject *ft_record(InFlightTable *t, PyObject *args) {
    PyObject *hashes; int worker; unsigned int epoch; double expiry;
    if (!PyArg_ParseTuple(args, "OiId", &hashes, &worker, &epoch, &expiry)) return NULL;
    if (worker < 0) { PyErr_SetString(PyExc_ValueError, "worker index must be >= 0"); return NULL; }
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    PyObject *ret = NULL;
    Keys K;
    if (keys_load(&K, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)) == 0) {
        if (ft_record_keys(t, &K, worker, epoch, expiry) == 0) ret = Py_NewRef(Py_None);
        keys_free(&K);
    }
    Py_DECREF(seq);
    return ret;
}

/* prev = cur if keep else empty; cur = empty: the array made ready for it (ft_prepare_fresh) if
 * there is one, else 1,024 slots. */
static int ft_rotate_gens(InFlightTable *t, int keep) {
    FGen fresh, fresh2;
    if (__atomic_load_n(&t->dbl.done, __ATOMIC_ACQUIRE)) ft_settle(t);
    else ft_abandon(t);                            /* not waited for: cur becomes prev as it is */
    size_t bytes = t->fresh.bytes;
    FSlot *ready = prep_take(&t->fresh, bytes);
    if (ready) { fresh.slots = ready; fresh.mask = bytes / sizeof(FSlot) - 1; fresh.count = 0; }
    else if (fg_alloc(&fresh, 1u << MIN_BITS) < 0) return -1;
    if (keep) { PyMem_RawFree(t->prev.slots); t->prev = t->cur; t->cur = fresh; return 0; }
    if (fg_alloc(&fresh2, 1u << MIN_BITS) < 0) { PyMem_RawFree(fresh.slots); return -1; }
    prep_drop(&t->next);                           /* sized for the cur dropped here */
    PyMem_RawFree(t->prev.slots); PyMem_RawFree(t->cur.slots);
    t->prev = fresh2; t->cur = fresh;
    return 0;
}

/* Half-way through a generation, the array the next one starts in is made ready off the routing
 * thread, sized so that twice what cur holds now (what it will hold at the end, at a steady rate)
 * keeps it at most half full: the next generation does not double its way up from 1,024 slots
 * (each doubling a rehash on the helper thread, and its delta laid over it by the router). */
static void ft_prepare_fresh(InFlightTable *t) {
    uint64_t cap = (uint64_t)1 << MIN_BITS;
    while (cap < 4 * (uint64_t)(t->cur.count + t->dbl.delta.count)) cap *= 2;
    if (cap < ((uint64_t)1 << PREP_MIN_BITS)) return;
    prep_start(&t->fresh, cap * sizeof(FSlot), fslots_init);
}

/* InFlightPrefixes._age: a generation lasts ttl; one older than 2 ttl is dropped whole. */
int ft_age(InFlightTable *t, double now, double ttl) {
    if (!t->has_gen) { t->gen_start = now; t->has_gen = 1; return 0; }
    if (now - t->gen_start < ttl) {
        if (!t->fresh.mem && now - t->gen_start >= ttl / 2) ft_prepare_fresh(t);
        return 0;
    }
    if (ft_rotate_gens(t, now - t->gen_start < 2 * ttl) < 0) return -1;
    t->gen_start = now;
    return 0;
}

static PyObject *ft_age_py(InFlightTable *t, PyObject *args) {
    double now, ttl;
    if (!PyArg_ParseTuple(args, "dd", &now, &ttl)) return NULL;
    if (ft_age(t, now, ttl) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ft_gen_start(InFlightTable *t, PyObject *unused) {
    return t->has_gen ? PyFloat_FromDouble(t->gen_start) : Py_NewRef(Py_None);
}

/* Whether an entry counts: not expired, and of its worker's current epoch (epochs: list of ints
 * by worker index). */
static int slot_live(const FSlot *s, double now, PyObject *epochs) {
    if (s->expiry <= now) return 0;
    if (s->worker >= PyList_GET_SIZE(epochs)) return s->epoch == 0;
    unsigned long e = PyLong_AsUnsignedLongMask(PyList_GET_ITEM(epochs, s->worker));
    return (uint32_t)e == s->epoch;
}

/* The live entry for key k (InFlightPrefixes._live): cur's if any, else prev's; NULL when absent,
 * expired or of an older epoch. */
static const FSlot *ft_live(const InFlightTable *t, uint64_t k, double now, PyObject *epochs) {
    const FSlot *s = ft_cur_find(t, k);
    if (!s) s = fg_find(&t->prev, k);
    return s && slot_live(s, now, epochs) ? s : NULL;
}

/* InFlightPrefixes.refresh: a pending send's chain kept live to ``expiry`` in cur, owners kept: a
 * live entry (cur's, or prev's copied into cur) lives at least to expiry; a missing, expired or
 * stale one (cur's shadows prev's) becomes this send's. */
static int ft_refresh_keys(InFlightTable *t, const Keys *K, int32_t worker, uint32_t epoch, double expiry,
                           double now, PyObject *epochs) {
    if (ft_room(t, K->n) < 0) return -1;                          /* at most half full, as record */
    FGen *g = ft_target(t);
    const FGen *pg = &t->prev, *frozen = t->dbl.running ? &t->cur : NULL;   /* cur under a doubling */
    for (Py_ssize_t i = 0; i < K->n && i < PREFETCH_AHEAD; i++) {
        __builtin_prefetch(&g->slots[mix(K->keys[i]) & g->mask], 1);
        if (pg->count) __builtin_prefetch(&pg->slots[mix(K->keys[i]) & pg->mask], 0);
    }
    for (Py_ssize_t i = 0; i < K->n; i++) {
        if (i + PREFETCH_AHEAD < K->n) {             /* both homes ahead: a prev read follows a cur miss */
            uint64_t h = mix(K->keys[i + PREFETCH_AHEAD]);
            __builtin_prefetch(&g->slots[h & g->mask], 1);
            if (pg->count) __builtin_prefetch(&pg->slots[h & pg->mask], 0);
        }
        FSlot mine = {K->keys[i], expiry, worker, epoch}, *s = fg_slot(g, K->keys[i]);
        const FSlot *c = F_EMPTY(s) ? NULL : s;      /* cur's entry: delta's (a tombstone: none), else frozen cur's */
        if (c && F_TOMB(c)) c = NULL;
        else if (!c && frozen) c = fg_find(frozen, K->keys[i]);
        if (c == s) {
            if (!slot_live(s, now, epochs)) *s = mine;
            else if (s->expiry < expiry) s->expiry = expiry;
            continue;
        }
        const FSlot *p = c ? c : (pg->count ? fg_find(pg, K->keys[i]) : NULL);
        if (c && !slot_live(c, now, epochs)) p = NULL;             /* cur's lapsed entry: this send's now */
        if (p && slot_live(p, now, epochs)) { mine = *p; if (mine.expiry < expiry) mine.expiry = expiry; }
        if (F_EMPTY(s)) g->count++;                /* the empty slot (or tombstone) found: nothing moved since */
        *s = mine;
    }
    ft_prepare(t);
    return 0;
}

/* refresh(hashes, worker, epoch, expiry, now, epochs) */
static PyObject *ft_refresh(InFlightTable *t, PyObject *args) {
    PyObject *hashes, *epochs; int worker; unsigned int epoch; double expiry, now;
    if (!PyArg_ParseTuple(args, "OiIddO!", &hashes, &worker, &epoch, &expiry, &now, &PyList_Type, &epochs))
        return NULL;
    if (worker < 0) { PyErr_SetString(PyExc_ValueError, "worker index must be >= 0"); return NULL; }
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence"), *ret = NULL;
    if (!seq) return NULL;
    Keys K;
    if (keys_load(&K, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)) == 0) {
        if (K.bad) PyErr_SetString(PyExc_OverflowError, "block hashes must be 64-bit unsigned ints");
        else if (ft_refresh_keys(t, &K, worker, epoch, expiry, now, epochs) == 0) ret = Py_NewRef(Py_None);
        keys_free(&K);
    }
    Py_DECREF(seq);
    return ret;
}

int32_t ft_match_keys(const InFlightTable *t, const Keys *K, double now, PyObject *epochs, Py_ssize_t *depth) {
    Py_ssize_t lo = 0, hi = K->n;
    const FSlot *best = K->n && K->ok[0] ? ft_live(t, K->keys[0], now, epochs) : NULL;
    while (best && hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) / 2;
        const FSlot *v = K->ok[mid] ? ft_live(t, K->keys[mid], now, epochs) : NULL;
        if (v) { lo = mid; best = v; } else hi = mid;
    }
    *depth = lo + 1;
    return best ? best->worker : -1;
}

/* match(hashes, now, epochs) -> (worker, blocks) or None: the deepest live block, by binary search. */
static PyObject *ft_match(InFlightTable *t, PyObject *args) {
    PyObject *hashes, *epochs; double now;
    if (!PyArg_ParseTuple(args, "OdO!", &hashes, &now, &PyList_Type, &epochs)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Keys K;
    int32_t worker = -1; Py_ssize_t depth = 0;
    if (keys_load(&K, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)) < 0) { Py_DECREF(seq); return NULL; }
    worker = ft_match_keys(t, &K, now, epochs, &depth);
    keys_free(&K);
    Py_DECREF(seq);
    if (worker < 0) Py_RETURN_NONE;
    return Py_BuildValue("(in)", worker, depth);
}

/* Removes k's entry owned by worker from cur: under a doubling, as a tombstone in delta. */
static void ft_cur_remove(InFlightTable *t, uint64_t k, int worker) {
    if (!t->dbl.running) {
        FSlot *s = t->cur.count ? fg_find(&t->cur, k) : NULL;
        if (s && s->worker == worker) fg_remove(&t->cur, s);
        return;
    }
    FGen *dl = &t->dbl.delta;
    FSlot *v = fg_slot(dl, k);
    if (!F_EMPTY(v)) { if (v->worker == worker) v->worker = -2; return; }   /* a tombstone has worker -2 */
    const FSlot *c = fg_find(&t->cur, k);
    if (c && c->worker == worker) { *v = (FSlot){k, 0.0, -2, 0}; dl->count++; }
}

/* on_removed(worker, hashes): drop these hashes' entries owned by worker, in both generations. */
static PyObject *ft_on_removed(InFlightTable *t, PyObject *args) {
    PyObject *hashes; int worker;
    if (!PyArg_ParseTuple(args, "iO", &worker, &hashes)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (t->dbl.running && ft_room(t, n) < 0) { Py_DECREF(seq); return NULL; }   /* delta's tombstones */
    FGen *pg = &t->prev;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k;
        if (to_key(items[i], &k) < 0) { PyErr_Clear(); continue; }
        ft_cur_remove(t, k, worker);
        FSlot *s = pg->count ? fg_find(pg, k) : NULL;
        if (s && s->worker == worker) fg_remove(pg, s);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* Distinct hashes in either generation (len of InFlightPrefixes). */
static Py_ssize_t ft_len(InFlightTable *t) {
    ft_settle(t);
    Py_ssize_t n = t->cur.count;
    for (uint64_t i = 0; i <= t->prev.mask; i++)
        if (t->prev.slots[i].worker >= 0 && !fg_find(&t->cur, t->prev.slots[i].key)) n++;
    return n;
}

int ft_is_empty(const InFlightTable *t) { return !t->cur.count && !t->dbl.delta.count && !t->prev.count; }

static PyObject *ft_empty(InFlightTable *t, PyObject *unused) {
    return PyBool_FromLong(ft_is_empty(t));
}

/* dump() -> (cur, prev): [(hash, worker, epoch, expiry)] per generation (to fall back to dicts). */
static PyObject *ft_dump(InFlightTable *t, PyObject *unused) {
    ft_settle(t);
    PyObject *out = PyTuple_New(2);
    for (int gi = 0; out && gi < 2; gi++) {
        const FGen *g = gi ? &t->prev : &t->cur;
        PyObject *lst = PyList_New(0);
        if (!lst) { Py_CLEAR(out); break; }
        PyTuple_SET_ITEM(out, gi, lst);
        for (uint64_t i = 0; i <= g->mask; i++) {
            const FSlot *s = &g->slots[i];
            if (s->worker < 0) continue;
            PyObject *item = Py_BuildValue("(KiId)", (unsigned long long)s->key, s->worker, s->epoch, s->expiry);
            if (!item || PyList_Append(lst, item) < 0) { Py_XDECREF(item); Py_CLEAR(out); break; }
            Py_DECREF(item);
        }
    }
    return out;
}

/* Bytes of both generations' slot arrays, of a next array made ready for cur, of the one made
 * ready for the next generation and of a doubling's array and delta. */
static PyObject *ft_nbytes(InFlightTable *t, PyObject *unused) {
    const Doubling *d = &t->dbl;
    uint64_t dbl = d->running ? d->to.mask + 1 + d->delta.mask + 1 : 0;
    return PyLong_FromUnsignedLongLong((t->cur.mask + 1 + t->prev.mask + 1 + dbl) * sizeof(FSlot) + t->next.bytes
                                       + t->fresh.bytes);
}

static PyObject *ft_doubling(InFlightTable *t, PyObject *unused) { return PyBool_FromLong(t->dbl.running); }

static PyMethodDef ft_methods[] = {
    {"nbytes", (PyCFunction)ft_nbytes, METH_NOARGS, "bytes of both generations' slot arrays and the arrays made ready (a doubling, the next generation)"},
    {"dump", (PyCFunction)ft_dump, METH_NOARGS, "dump() -> (cur, prev) lists of (hash, worker, epoch, expiry)"},
    {"record", (PyCFunction)ft_record, METH_VARARGS, "record(hashes, worker, epoch, expiry)"},
    {"refresh", (PyCFunction)ft_refresh, METH_VARARGS, "refresh(hashes, worker, epoch, expiry, now, epochs)"},
    {"age", (PyCFunction)ft_age_py, METH_VARARGS, "age(now, ttl): start a generation every ttl (InFlightPrefixes._age)"},
    {"gen_start", (PyCFunction)ft_gen_start, METH_NOARGS, "the current generation's start, or None"},
    {"match", (PyCFunction)ft_match, METH_VARARGS, "match(hashes, now, epochs) -> (worker, blocks) | None"},
    {"on_removed", (PyCFunction)ft_on_removed, METH_VARARGS, "on_removed(worker, hashes)"},
    {"empty", (PyCFunction)ft_empty, METH_NOARGS, "no entry in either generation"},
    {"doubling", (PyCFunction)ft_doubling, METH_NOARGS, "whether a doubling of the current generation runs off the routing thread"},
    {NULL}
};

TABLE_TYPE(InFlightTableType, "routerfast.InFlightTable", InFlightTable, ft)

