/* BlockTable: block hash -> the three 64-bit lanes of PrefixIndex._held (any tier, off device,
 * disk), a mirror kept in step per KV event (sync). walk() is PrefixIndex._walk + _emit in C:
 * every prompt block probed with prefetches running ahead, so the cache misses overlap. */
#include "routerfast.h"

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

/* PrefixIndex._walk for lane 64: every prompt block probed, prefetches running ahead. */
void bt_walk_keys(const BlockTable *t, const Keys *K, Walk *w) {
    const uint64_t *keys = K->keys; const char *ok = K->ok; Py_ssize_t n = K->n, length = 0;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
        __builtin_prefetch(&t->slots[mix(keys[i]) & t->mask]);
    uint64_t alive = 0;
    w->first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&t->slots[mix(keys[i + PREFETCH_AHEAD]) & t->mask]);
        const BSlot *s = ok[i] ? bt_find(t, keys[i]) : NULL;
        uint64_t any = s ? s->any : 0;
        if (i == 0) {
            w->first = alive = any;
            for (uint64_t g = any; g; g &= g - 1) { int b = __builtin_ctzll(g); w->host[b] = w->disk[b] = 0; }
        }
        uint64_t m = any & alive;
        if (m != alive) {
            for (uint64_t g = alive & ~m; g; g &= g - 1) w->length[__builtin_ctzll(g)] = length;
            alive = m;
        }
        if (!alive) break;
        for (uint64_t o = s->off & alive; o; o &= o - 1) {
            int b = __builtin_ctzll(o);
            if (s->disk >> b & 1) w->disk[b]++; else w->host[b]++;
        }
        length++;
    }
    for (uint64_t g = alive; g; g &= g - 1) w->length[__builtin_ctzll(g)] = length;
}

typedef struct { uint64_t mask; Py_ssize_t length, host, disk; } Group;

/* The walk's workers grouped by (length, host, disk), as PrefixIndex emits them: by length,
 * device-only first. Returns the number of groups. */
static int group_walk(const Walk *w, Group groups[LANE]) {
    int ng = 0;
    for (uint64_t g = w->first; g; g &= g - 1) {
        int b = __builtin_ctzll(g), j = 0;
        while (j < ng && !(groups[j].length == w->length[b] && groups[j].host == w->host[b] && groups[j].disk == w->disk[b])) j++;
        if (j == ng) { groups[ng] = (Group){0, w->length[b], w->host[b], w->disk[b]}; ng++; }
        groups[j].mask |= 1ULL << b;
    }
    for (int j = 1; j < ng; j++) {
        Group g = groups[j]; int i = j;
        while (i > 0 && (groups[i - 1].length > g.length || (groups[i - 1].length == g.length &&
               !(groups[i - 1].host || groups[i - 1].disk) < !(g.host || g.disk)))) { groups[i] = groups[i - 1]; i--; }
        groups[i] = g;
    }
    return ng;
}

/* walk(hashes) -> [(mask, length, host_blocks, disk_blocks)]: PrefixIndex._walk for lane 64. */
static PyObject *bt_walk(BlockTable *t, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (!seq) return NULL;
    PyObject *out = NULL;
    Keys K;
    if (keys_load(&K, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq)) < 0) goto done;
    Walk w;
    Group groups[LANE];
    bt_walk_keys(t, &K, &w);
    int ng = group_walk(&w, groups);
    out = PyList_New(ng);
    for (int j = 0; out && j < ng; j++) {
        PyObject *item = Py_BuildValue("(Knnn)", (unsigned long long)groups[j].mask, groups[j].length,
                                       groups[j].host, groups[j].disk);
        if (!item) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, j, item);
    }
    keys_free(&K);
done:
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

