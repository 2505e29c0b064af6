/* Decider's state: workers (slots), their loads as reported plus the optimistic additions of
 * the decisions since, the live workers by role in the view's order, which slot each index bit
 * and in-flight number names. The Router (cluster/router/native_router.py) writes a change here
 * when it happens; decide.c reads it per decision without any marshalling. */
#include "decider.h"

static PyObject *dc_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Decider *d = (Decider *)type->tp_alloc(type, 0);
    PyObject *blocks, *flight, *epochs, *spec;
    if (!d) return NULL;
    for (int b = 0; b < LANE; b++) d->bit_slot[b] = -1;
    if (!PyArg_ParseTuple(args, "O!OO(dddddddddd)LdpddO", &BlockTableType, &blocks, &flight, &epochs,
                          &d->w[0], &d->w[1], &d->w[2], &d->w[3], &d->w[4], &d->w[5], &d->w[6], &d->w[7], &d->w[8], &d->w[9],
                          &d->threshold, &d->hit_ratio, &d->colocated, &d->pending_ttl, &d->flight_ttl, &spec))
        goto fail;
    if (flight != Py_None && (!PyObject_TypeCheck(flight, &InFlightTableType) || !PyList_Check(epochs))) {
        PyErr_SetString(PyExc_TypeError, "flight must be an InFlightTable (with its epochs list) or None");
        goto fail;
    }
    d->blocks = (BlockTable *)Py_NewRef(blocks);
    if (flight != Py_None) { d->flight = (InFlightTable *)Py_NewRef(flight); d->epochs = Py_NewRef(epochs); }
    if (records_init(&d->rec, spec) < 0) goto fail;
    return (PyObject *)d;
fail:
    Py_DECREF(d);
    return NULL;
}

static void dc_dealloc(Decider *d) {
    for (Py_ssize_t i = 0; i < d->nslots; i++) Py_XDECREF(d->slots[i].id);
    PyMem_Free(d->slots); PyMem_Free(d->flight_slot); PyMem_Free(d->role[0]); PyMem_Free(d->role[1]);
    Py_XDECREF(d->blocks); Py_XDECREF(d->flight); Py_XDECREF(d->epochs);
    records_clear(&d->rec);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static WSlot *slot_at(Decider *d, Py_ssize_t i) {
    if (i < 0 || i >= d->nslots || !d->slots[i].id) { PyErr_Format(PyExc_IndexError, "no worker slot %zd", i); return NULL; }
    return &d->slots[i];
}

/* add(worker_id, flight_number) -> slot: a new worker, load 0, not yet live in a role. */
static PyObject *dc_add(Decider *d, PyObject *args) {
    PyObject *id; int flight;
    if (!PyArg_ParseTuple(args, "Ui", &id, &flight)) return NULL;
    if (d->nslots == d->cap) {
        Py_ssize_t cap = d->cap ? 2 * d->cap : 16;
        WSlot *s = PyMem_Realloc(d->slots, cap * sizeof(WSlot));
        if (!s) return PyErr_NoMemory();
        d->slots = s; d->cap = cap;
    }
    if (flight >= d->nflight) {
        Py_ssize_t n = 2 * (Py_ssize_t)flight + 16;
        int32_t *m = PyMem_Realloc(d->flight_slot, n * sizeof(int32_t));
        if (!m) return PyErr_NoMemory();
        for (Py_ssize_t i = d->nflight; i < n; i++) m[i] = -1;
        d->flight_slot = m; d->nflight = n;
    }
    Py_ssize_t i = d->nslots++;
    d->slots[i] = (WSlot){.id = Py_NewRef(id), .flight = flight};
    if (flight >= 0) d->flight_slot[flight] = (int32_t)i;
    return PyLong_FromSsize_t(i);
}

/* remove(slot): the worker left for good; its index bit and in-flight number name nobody. */
static PyObject *dc_remove(Decider *d, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    WSlot *s = i == -1 && PyErr_Occurred() ? NULL : slot_at(d, i);
    if (!s) return NULL;
    for (int b = 0; b < LANE; b++) if (d->bit_slot[b] == i) d->bit_slot[b] = -1;
    if (s->flight >= 0 && d->flight_slot[s->flight] == i) d->flight_slot[s->flight] = -1;
    Py_CLEAR(s->id);
    Py_RETURN_NONE;
}

/* set_load(slot, queued, running, waiting, kv): a load report; the optimistic additions end. */
static PyObject *dc_set_load(Decider *d, PyObject *args) {
    Py_ssize_t i; long long q, r, w; double kv;
    if (!PyArg_ParseTuple(args, "nLLLd", &i, &q, &r, &w, &kv)) return NULL;
    WSlot *s = slot_at(d, i);
    if (!s) return NULL;
    s->queued = q; s->running = r; s->waiting = w; s->kv = kv;
    s->pend_tokens = s->pend_running = 0; s->has_until = 0;
    Py_RETURN_NONE;
}

/* set_bit(bit, slot): index bit -> slot (-1: nobody the router knows). */
static PyObject *dc_set_bit(Decider *d, PyObject *args) {
    int bit; int slot;
    if (!PyArg_ParseTuple(args, "ii", &bit, &slot)) return NULL;
    if (bit < 0 || bit >= LANE) { PyErr_SetString(PyExc_ValueError, "index bits are 0..63 here"); return NULL; }
    if (slot != -1 && !slot_at(d, slot)) return NULL;
    d->bit_slot[bit] = slot;
    Py_RETURN_NONE;
}

static int set_role(Decider *d, int role, PyObject *slots) {
    PyObject *seq = PySequence_Fast(slots, "a role's slots must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int32_t *r = PyMem_Malloc((n ? n : 1) * sizeof(int32_t));
    if (!r) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, j));
        if ((i == -1 && PyErr_Occurred()) || !slot_at(d, i)) { PyMem_Free(r); Py_DECREF(seq); return -1; }
        r[j] = (int32_t)i;
    }
    Py_DECREF(seq);
    PyMem_Free(d->role[role]);
    d->role[role] = r; d->nrole[role] = n;
    return 0;
}

/* set_roles(prefill_slots, decode_slots): the live workers of each role, in the view's order. */
static PyObject *dc_set_roles(Decider *d, PyObject *args) {
    PyObject *p, *q;
    if (!PyArg_ParseTuple(args, "OO", &p, &q) || set_role(d, PREFILL, p) < 0 || set_role(d, DECODE, q) < 0) return NULL;
    Py_RETURN_NONE;
}

/* load(slot) -> (queued, running, waiting, kv): as reported plus the optimistic additions. */
static PyObject *dc_load(Decider *d, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    WSlot *s = i == -1 && PyErr_Occurred() ? NULL : slot_at(d, i);
    if (!s) return NULL;
    return Py_BuildValue("(LLLd)", eff_queued(s), eff_running(s), s->waiting, s->kv);
}

/* pending(slot) -> (tokens, running, until | None): to hand the bookkeeping back to Python. */
static PyObject *dc_pending(Decider *d, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    WSlot *s = i == -1 && PyErr_Occurred() ? NULL : slot_at(d, i);
    if (!s) return NULL;
    PyObject *until = s->has_until ? PyFloat_FromDouble(s->until) : Py_NewRef(Py_None);
    return Py_BuildValue("(LLN)", s->pend_tokens, s->pend_running, until);
}

/* assigned(slot) -> prompt tokens routed to it to compute since it was added. */
static PyObject *dc_assigned(Decider *d, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    WSlot *s = i == -1 && PyErr_Occurred() ? NULL : slot_at(d, i);
    return s ? PyLong_FromLongLong(s->assigned) : NULL;
}

static PyObject *dc_next_expiry(Decider *d, PyObject *unused) {
    return d->has_next ? PyFloat_FromDouble(d->next_expiry) : Py_NewRef(Py_None);
}

static PyMethodDef dc_methods[] = {
    {"add", (PyCFunction)dc_add, METH_VARARGS, "add(worker_id, in_flight_number) -> slot"},
    {"remove", (PyCFunction)dc_remove, METH_O, "remove(slot)"},
    {"set_load", (PyCFunction)dc_set_load, METH_VARARGS, "set_load(slot, queued, running, waiting, kv)"},
    {"set_bit", (PyCFunction)dc_set_bit, METH_VARARGS, "set_bit(index_bit, slot or -1)"},
    {"set_roles", (PyCFunction)dc_set_roles, METH_VARARGS, "set_roles(prefill_slots, decode_slots)"},
    {"load", (PyCFunction)dc_load, METH_O, "load(slot) -> (queued, running, waiting, kv_usage)"},
    {"pending", (PyCFunction)dc_pending, METH_O, "pending(slot) -> (tokens, running, until or None)"},
    {"assigned", (PyCFunction)dc_assigned, METH_O, "assigned(slot) -> prompt tokens routed to it to compute"},
    {"next_expiry", (PyCFunction)dc_next_expiry, METH_NOARGS, "when the first optimistic addition lapses, or None"},
    {"decide", (PyCFunction)(void (*)(void))decider_decide, METH_FASTCALL,
     "decide(hashes, prompt_tokens, block_size, request_id, tie_key, now) -> RoutingDecision | None"},
    {NULL}
};

PyTypeObject DeciderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "routerfast.Decider", .tp_basicsize = sizeof(Decider), .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = dc_new, .tp_dealloc = (destructor)dc_dealloc, .tp_methods = dc_methods,
};
