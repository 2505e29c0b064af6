/* Flat open-addressing tables for the router's hot path (cluster/router/native.py builds this).
 *
 * BlockTable: block hash -> the three 64-bit lanes of PrefixIndex._held (any tier, off device,
 *   disk), a mirror kept in step per KV event (sync). walk() is PrefixIndex._walk + _emit in C:
 *   every prompt block probed with prefetches running ahead, so the cache misses overlap.
 * InFlightTable: InFlightPrefixes' two generations (hash -> worker, epoch, expiry) as two tables.
 *
 * Linear probing, a multiplicative mix of the key for the home slot, deletion by backward shift
 * (no tombstones). Memory comes from PyMem_Raw* so tracemalloc counts it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#define PREFETCH_AHEAD 16
#define MIN_BITS 10

/* A table's Python type: its methods, len(), constructor and destructor, named by prefix. */
#define TABLE_TYPE(var, name, cls, pre) \
    static PySequenceMethods pre##_seq = {.sq_length = (lenfunc)pre##_len}; \
    static PyTypeObject var = { \
        PyVarObject_HEAD_INIT(NULL, 0) \
        .tp_name = name, .tp_basicsize = sizeof(cls), .tp_flags = Py_TPFLAGS_DEFAULT, \
        .tp_new = pre##_new, .tp_dealloc = (destructor)pre##_dealloc, \
        .tp_methods = pre##_methods, .tp_as_sequence = &pre##_seq, \
    };

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; return k;
}

/* Ask for transparent huge pages over a big table (before its first touch): a probe then
 * costs one cache miss, not a cache miss plus a TLB miss (THP in "madvise" mode). */
static void want_huge_pages(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1), hi = ((uintptr_t)p + n) & ~(huge - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#endif
}

static int to_key(PyObject *h, uint64_t *out) {
    uint64_t k = PyLong_AsUnsignedLongLong(h);
    if (k == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *out = k;
    return 0;
}

/* keys[i]: items[i] as a 64-bit key; ok[i] 0 where it is not one. */
static void keys_of(PyObject **items, Py_ssize_t n, uint64_t *keys, char *ok) {
    for (Py_ssize_t i = 0; i < n; i++) {
        ok[i] = to_key(items[i], &keys[i]) == 0;
        if (!ok[i]) PyErr_Clear();              /* not a 64-bit hash: indexed by nobody here */
    }
}

/* find / place / grow / remove for a table type T (fields slots, mask, count; pre##_alloc
 * defined) of slot type S: EMPTY(s) says whether a slot is free, CLEAR(s) frees it. */
#define OPEN_ADDRESSING(pre, T, S, EMPTY, CLEAR) \
    static S *pre##_find(const T *t, uint64_t k) { \
        uint64_t i = mix(k) & t->mask; \
        for (;;) { \
            S *s = &t->slots[i]; \
            if (EMPTY(s)) return NULL; \
            if (s->key == k) return s; \
            i = (i + 1) & t->mask; \
        } \
    } \
    static void pre##_place(T *t, const S *v) { \
        uint64_t i = mix(v->key) & t->mask; \
        while (!EMPTY(&t->slots[i])) i = (i + 1) & t->mask; \
        t->slots[i] = *v; \
        t->count++; \
    } \
    static int pre##_grow(T *t) { \
        S *old = t->slots; uint64_t cap = t->mask + 1; \
        if (pre##_alloc(t, cap * 2) < 0) return -1; \
        for (uint64_t i = 0; i < cap; i++) if (!EMPTY(&old[i])) pre##_place(t, &old[i]); \
        PyMem_RawFree(old); \
        return 0; \
    } \
    static void pre##_remove(T *t, S *s) {       /* backward shift: no tombstones */ \
        uint64_t i = (uint64_t)(s - t->slots), j = i, m = t->mask; \
        for (;;) { \
            j = (j + 1) & m; \
            if (EMPTY(&t->slots[j])) break; \
            uint64_t home = mix(t->slots[j].key) & m; \
            if (((j - home) & m) >= ((j - i) & m)) { t->slots[i] = t->slots[j]; i = j; } \
        } \
        CLEAR(&t->slots[i]); \
        t->count--; \
    }

/* A call's keys: on the stack up to 256, else on the heap (keys_free either way). */
typedef struct { uint64_t *keys; char *ok; uint64_t kstack[256]; char okstack[256]; } Keys;

static void keys_free(Keys *k) {
    if (k->keys != k->kstack) PyMem_Free(k->keys);
    if (k->ok != k->okstack) PyMem_Free(k->ok);
    k->keys = k->kstack; k->ok = k->okstack;
}

static int keys_load(Keys *k, PyObject **items, Py_ssize_t n) {
    k->keys = k->kstack; k->ok = k->okstack;
    if (n > 256) {
        k->keys = PyMem_Malloc(n * sizeof(uint64_t)); k->ok = PyMem_Malloc(n);
        if (!k->keys || !k->ok) { keys_free(k); PyErr_NoMemory(); return -1; }
    }
    keys_of(items, n, k->keys, k->ok);
    return 0;
}

/* ------------------------------------------------------------------ BlockTable */
typedef struct { uint64_t key, any, off, disk; } BSlot;     /* any == 0: empty */

typedef struct {
    PyObject_HEAD
    BSlot *slots;
    uint64_t mask;
    Py_ssize_t count;
} BlockTable;

static int bt_alloc(BlockTable *t, uint64_t cap) {
    BSlot *s = PyMem_RawMalloc(cap * sizeof(BSlot));
    if (!s) { PyErr_NoMemory(); return -1; }
    want_huge_pages(s, cap * sizeof(BSlot));
    memset(s, 0, cap * sizeof(BSlot));
    t->slots = s; t->mask = cap - 1; t->count = 0;
    return 0;
}

#define B_EMPTY(s) (!(s)->any)
#define B_CLEAR(s) memset((s), 0, sizeof(BSlot))
OPEN_ADDRESSING(bt, BlockTable, BSlot, B_EMPTY, B_CLEAR)

static int bt_put(BlockTable *t, uint64_t k, const uint64_t w[3]) {
    BSlot *s = bt_find(t, k);
    if (s) { s->any = w[0]; s->off = w[1]; s->disk = w[2]; return 0; }
    if ((uint64_t)(t->count + 1) * 5 > (t->mask + 1) * 4 && bt_grow(t) < 0) return -1;   /* load <= 0.8 */
    BSlot v = {k, w[0], w[1], w[2]};
    bt_place(t, &v);
    return 0;
}

static void bt_del(BlockTable *t, uint64_t k) {
    BSlot *s = bt_find(t, k);
    if (s) bt_remove(t, s);
}

static int split3(PyObject *v, uint64_t w[3]) {
    unsigned char buf[24];
    if (!PyLong_Check(v)) { PyErr_SetString(PyExc_TypeError, "packed masks must be ints"); return -1; }
#if PY_VERSION_HEX >= 0x030D0000
    if (_PyLong_AsByteArray((PyLongObject *)v, buf, 24, 1, 0, 1) < 0) return -1;
#else
    if (_PyLong_AsByteArray((PyLongObject *)v, buf, 24, 1, 0) < 0) return -1;
#endif
    for (int j = 0; j < 3; j++) { uint64_t x = 0; for (int b = 7; b >= 0; b--) x = x << 8 | buf[8 * j + b]; w[j] = x; }
    return 0;
}

static PyObject *bt_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t && bt_alloc(t, 1u << MIN_BITS) < 0) { Py_DECREF(t); return NULL; }
    return (PyObject *)t;
}

static void bt_dealloc(BlockTable *t) {
    PyMem_RawFree(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* sync(hashes, held): make these hashes' entries equal held.get(h) (absent: removed). */
static PyObject *bt_sync(BlockTable *t, PyObject *args) {
    PyObject *hashes, *held;
    if (!PyArg_ParseTuple(args, "OO!", &hashes, &PyDict_Type, &held)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq), *ret = NULL;
    Keys K;
    if (keys_load(&K, items, n) < 0) goto done;
    const uint64_t *keys = K.keys; const char *ok = K.ok;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) __builtin_prefetch(&t->slots[mix(keys[i]) & t->mask], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w[3];
        if (!ok[i]) { PyErr_SetString(PyExc_OverflowError, "block hashes must be 64-bit unsigned ints"); goto done; }
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&t->slots[mix(keys[i + PREFETCH_AHEAD]) & t->mask], 1);
        PyObject *v = PyDict_GetItemWithError(held, items[i]);
        if (!v) {
            if (PyErr_Occurred()) goto done;
            bt_del(t, keys[i]);
            continue;
        }
        if (split3(v, w) < 0) goto done;
        if (!w[0]) { PyErr_SetString(PyExc_ValueError, "a held block with no holder"); goto done; }
        if (bt_put(t, keys[i], w) < 0) goto done;
    }
    ret = Py_NewRef(Py_None);
done:
    keys_free(&K);
    Py_DECREF(seq);
    return ret;
}

static PyObject *bt_get(BlockTable *t, PyObject *h) {
    uint64_t k;
    if (to_key(h, &k) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    BSlot *s = bt_find(t, k);
    if (!s) Py_RETURN_NONE;
    unsigned char buf[24];
    uint64_t w[3] = {s->any, s->off, s->disk};
    for (int j = 0; j < 3; j++) for (int b = 0; b < 8; b++) buf[8 * j + b] = (unsigned char)(w[j] >> (8 * b));
    return _PyLong_FromByteArray(buf, 24, 1, 0);
}

typedef struct { uint64_t mask; Py_ssize_t length, host, disk; } Group;

/* walk(hashes) -> [(mask, length, host_blocks, disk_blocks)]: PrefixIndex._walk for lane 64. */
static PyObject *bt_walk(BlockTable *t, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq), *out = NULL;
    Keys K;
    if (keys_load(&K, items, n) < 0) goto done;
    const uint64_t *keys = K.keys; const char *ok = K.ok;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        __builtin_prefetch(&t->slots[mix(keys[i]) & t->mask]);
    Py_ssize_t len_of[64], host[64] = {0}, disk[64] = {0}, length = 0;
    uint64_t alive = 0, first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&t->slots[mix(keys[i + PREFETCH_AHEAD]) & t->mask]);
        const BSlot *s = ok[i] ? bt_find(t, keys[i]) : NULL;
        uint64_t any = s ? s->any : 0;
        if (i == 0) first = alive = any;
        uint64_t m = any & alive;
        if (m != alive) {
            for (uint64_t g = alive & ~m; g; g &= g - 1) len_of[__builtin_ctzll(g)] = length;
            alive = m;
        }
        if (!alive) break;
        uint64_t o = s->off & alive;
        for (; o; o &= o - 1) {
            int b = __builtin_ctzll(o);
            if (s->disk >> b & 1) disk[b]++; else host[b]++;
        }
        length++;
    }
    for (uint64_t g = alive; g; g &= g - 1) len_of[__builtin_ctzll(g)] = length;
    Group groups[64]; int ng = 0;
    for (uint64_t g = first; g; g &= g - 1) {
        int b = __builtin_ctzll(g), j = 0;
        while (j < ng && !(groups[j].length == len_of[b] && groups[j].host == host[b] && groups[j].disk == disk[b])) j++;
        if (j == ng) { groups[ng].mask = 0; groups[ng].length = len_of[b]; groups[ng].host = host[b]; groups[ng].disk = disk[b]; ng++; }
        groups[j].mask |= 1ULL << b;
    }
    for (int j = 1; j < ng; j++) {               /* as PrefixIndex emits: by length, device-only first */
        Group g = groups[j]; int i = j;
        while (i > 0 && (groups[i - 1].length > g.length || (groups[i - 1].length == g.length &&
               !(groups[i - 1].host || groups[i - 1].disk) < !(g.host || g.disk)))) { groups[i] = groups[i - 1]; i--; }
        groups[i] = g;
    }
    out = PyList_New(ng);
    for (int j = 0; out && j < ng; j++) {
        PyObject *item = Py_BuildValue("(Knnn)", (unsigned long long)groups[j].mask, groups[j].length,
                                       groups[j].host, groups[j].disk);
        if (!item) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, j, item);
    }
done:
    keys_free(&K);
    Py_DECREF(seq);
    return out;
}

static Py_ssize_t bt_len(BlockTable *t) { return t->count; }

static PyObject *bt_nbytes(BlockTable *t, PyObject *unused) {
    return PyLong_FromUnsignedLongLong((t->mask + 1) * sizeof(BSlot));
}

static PyMethodDef bt_methods[] = {
    {"sync", (PyCFunction)bt_sync, METH_VARARGS, "sync(hashes, held): copy these hashes' entries from held (absent: drop)"},
    {"walk", (PyCFunction)bt_walk, METH_O, "walk(hashes) -> [(mask, length, host, disk)]"},
    {"get", (PyCFunction)bt_get, METH_O, "get(hash) -> packed int or None"},
    {"nbytes", (PyCFunction)bt_nbytes, METH_NOARGS, "bytes of the slot array"},
    {NULL}
};

TABLE_TYPE(BlockTableType, "routerfast.BlockTable", BlockTable, bt)

/* ------------------------------------------------------------------ InFlightTable */
typedef struct { uint64_t key; double expiry; int32_t worker; uint32_t epoch; } FSlot;   /* worker < 0: empty */
typedef struct { FSlot *slots; uint64_t mask; Py_ssize_t count; } FGen;

typedef struct {
    PyObject_HEAD
    FGen cur, prev;
} InFlightTable;

static int fg_alloc(FGen *g, uint64_t cap) {
    FSlot *s = PyMem_RawMalloc(cap * sizeof(FSlot));
    if (!s) { PyErr_NoMemory(); return -1; }
    want_huge_pages(s, cap * sizeof(FSlot));
    for (uint64_t i = 0; i < cap; i++) s[i].worker = -1;
    g->slots = s; g->mask = cap - 1; g->count = 0;
    return 0;
}

#define F_EMPTY(s) ((s)->worker < 0)
#define F_CLEAR(s) ((s)->worker = -1)
OPEN_ADDRESSING(fg, FGen, FSlot, F_EMPTY, F_CLEAR)

static PyObject *ft_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    InFlightTable *t = (InFlightTable *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    if (fg_alloc(&t->cur, 1u << MIN_BITS) < 0) { Py_DECREF(t); return NULL; }
    if (fg_alloc(&t->prev, 1u << MIN_BITS) < 0) { Py_DECREF(t); return NULL; }
    return (PyObject *)t;
}

static void ft_dealloc(InFlightTable *t) {
    PyMem_RawFree(t->cur.slots);
    PyMem_RawFree(t->prev.slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* record(hashes, worker, epoch, expiry): the current generation maps each hash to this send. */
static PyObject *ft_record(InFlightTable *t, PyObject *args) {
    PyObject *hashes; int worker; unsigned int epoch; double expiry;
    if (!PyArg_ParseTuple(args, "OiId", &hashes, &worker, &epoch, &expiry)) return NULL;
    if (worker < 0) { PyErr_SetString(PyExc_ValueError, "worker index must be >= 0"); return NULL; }
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    FGen *g = &t->cur;
    PyObject *ret = NULL;
    Keys K;
    if (keys_load(&K, items, n) < 0) goto done;
    const uint64_t *keys = K.keys; const char *ok = K.ok;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!ok[i]) { PyErr_SetString(PyExc_OverflowError, "block hashes must be 64-bit unsigned ints"); goto done; }
    while ((uint64_t)(g->count + n) * 4 > (g->mask + 1) * 3)     /* load <= 0.75 after this send */
        if (fg_grow(g) < 0) goto done;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) __builtin_prefetch(&g->slots[mix(keys[i]) & g->mask], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&g->slots[mix(keys[i + PREFETCH_AHEAD]) & g->mask], 1);
        FSlot *s = fg_find(g, keys[i]);
        FSlot v = {keys[i], expiry, worker, epoch};
        if (s) *s = v; else fg_place(g, &v);
    }
    ret = Py_NewRef(Py_None);
done:
    keys_free(&K);
    Py_DECREF(seq);
    return ret;
}

/* rotate(keep): the generations age: prev = cur if keep else empty; cur = empty. */
static PyObject *ft_rotate(InFlightTable *t, PyObject *keep) {
    FGen fresh;
    if (fg_alloc(&fresh, 1u << MIN_BITS) < 0) return NULL;
    int k = PyObject_IsTrue(keep);
    if (k < 0) { PyMem_RawFree(fresh.slots); return NULL; }
    if (k) { PyMem_RawFree(t->prev.slots); t->prev = t->cur; t->cur = fresh; return Py_NewRef(Py_None); }
    FGen fresh2;
    if (fg_alloc(&fresh2, 1u << MIN_BITS) < 0) { PyMem_RawFree(fresh.slots); return NULL; }
    PyMem_RawFree(t->prev.slots); PyMem_RawFree(t->cur.slots);
    t->prev = fresh2; t->cur = fresh;
    Py_RETURN_NONE;
}

/* The live entry for key k (InFlightPrefixes._live): cur's if any, else prev's; NULL when absent,
 * expired or of an older epoch (epochs: list of ints by worker index). */
static const FSlot *ft_live(const InFlightTable *t, uint64_t k, double now, PyObject *epochs) {
    const FSlot *s = fg_find(&t->cur, k);
    if (!s) s = fg_find(&t->prev, k);
    if (!s || s->expiry <= now) return NULL;
    if (s->worker >= PyList_GET_SIZE(epochs)) return s->epoch == 0 ? s : NULL;
    unsigned long e = PyLong_AsUnsignedLongMask(PyList_GET_ITEM(epochs, s->worker));
    return (uint32_t)e == s->epoch ? s : NULL;
}

/* match(hashes, now, epochs) -> (worker, blocks) or None: the deepest live block, by binary search. */
static PyObject *ft_match(InFlightTable *t, PyObject *args) {
    PyObject *hashes, *epochs; double now;
    if (!PyArg_ParseTuple(args, "OdO!", &hashes, &now, &PyList_Type, &epochs)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), lo = 0, hi = n;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const FSlot *best = NULL;
    uint64_t k;
    if (n && to_key(items[0], &k) == 0) best = ft_live(t, k, now, epochs);
    PyErr_Clear();
    while (best && hi - lo > 1) {
        Py_ssize_t mid = (lo + hi) / 2;
        const FSlot *v = NULL;
        if (to_key(items[mid], &k) == 0) v = ft_live(t, k, now, epochs); else PyErr_Clear();
        if (v) { lo = mid; best = v; } else hi = mid;
    }
    Py_DECREF(seq);
    if (!best) Py_RETURN_NONE;
    return Py_BuildValue("(in)", best->worker, lo + 1);
}

/* on_removed(worker, hashes): drop these hashes' entries owned by worker, in both generations. */
static PyObject *ft_on_removed(InFlightTable *t, PyObject *args) {
    PyObject *hashes; int worker;
    if (!PyArg_ParseTuple(args, "iO", &worker, &hashes)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (int gi = 0; gi < 2; gi++) {
        FGen *g = gi ? &t->prev : &t->cur;
        for (Py_ssize_t i = 0; g->count && i < n; i++) {
            uint64_t k;
            if (to_key(items[i], &k) < 0) { PyErr_Clear(); continue; }
            FSlot *s = fg_find(g, k);
            if (s && s->worker == worker) fg_remove(g, s);
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* Distinct hashes in either generation (len of InFlightPrefixes). */
static Py_ssize_t ft_len(InFlightTable *t) {
    Py_ssize_t n = t->cur.count;
    for (uint64_t i = 0; i <= t->prev.mask; i++)
        if (t->prev.slots[i].worker >= 0 && !fg_find(&t->cur, t->prev.slots[i].key)) n++;
    return n;
}

static PyObject *ft_empty(InFlightTable *t, PyObject *unused) {
    return PyBool_FromLong(!t->cur.count && !t->prev.count);
}

/* dump() -> (cur, prev): [(hash, worker, epoch, expiry)] per generation (to fall back to dicts). */
static PyObject *ft_dump(InFlightTable *t, PyObject *unused) {
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

static PyMethodDef ft_methods[] = {
    {"dump", (PyCFunction)ft_dump, METH_NOARGS, "dump() -> (cur, prev) lists of (hash, worker, epoch, expiry)"},
    {"record", (PyCFunction)ft_record, METH_VARARGS, "record(hashes, worker, epoch, expiry)"},
    {"rotate", (PyCFunction)ft_rotate, METH_O, "rotate(keep): prev = cur if keep else empty; cur = empty"},
    {"match", (PyCFunction)ft_match, METH_VARARGS, "match(hashes, now, epochs) -> (worker, blocks) | None"},
    {"on_removed", (PyCFunction)ft_on_removed, METH_VARARGS, "on_removed(worker, hashes)"},
    {"empty", (PyCFunction)ft_empty, METH_NOARGS, "no entry in either generation"},
    {NULL}
};

TABLE_TYPE(InFlightTableType, "routerfast.InFlightTable", InFlightTable, ft)

/* ------------------------------------------------------------------ module */
static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "routerfast", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_routerfast(void) {
    if (PyType_Ready(&BlockTableType) < 0 || PyType_Ready(&InFlightTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&BlockTableType); Py_INCREF(&InFlightTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0 ||
        PyModule_AddObject(m, "InFlightTable", (PyObject *)&InFlightTableType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
