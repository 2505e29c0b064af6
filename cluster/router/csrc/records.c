/* The decision's records built in C: RoutingDecision, CostInputs, MatchInfo and WorkerLoad are
 * frozen dataclasses with __slots__, so an instance is its type's allocation plus one object
 * pointer per field, at the offset the type's member table gives. Filling them here (values
 * already checked: counts >= 0, a live worker) saves the seven Python constructor calls of a
 * decision (about 4.5 us: each field through object.__setattr__, plus the __post_init__
 * checks). tests/unit/test_router_decider.py compares them with the Python path's. */
#include "records.h"
#include <structmember.h>
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif

/* The offsets of ``fields`` (a tuple of names, in the constructor's order) in ``cls``'s slots. */
int layout_of(PyObject *cls, PyObject *fields, Layout *out) {
    if (!PyType_Check(cls) || !PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) > MAX_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "a record layout needs a class and a tuple of at most 9 field names");
        return -1;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    if (type->tp_dictoffset != 0 || !type->tp_members) {
        PyErr_Format(PyExc_TypeError, "%s has no __slots__ layout: declare it @dataclass(slots=True)", type->tp_name);
        return -1;
    }
    out->type = type;
    out->n = (int)PyTuple_GET_SIZE(fields);
    for (int i = 0; i < out->n; i++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(fields, i));
        if (!name) return -1;
        out->off[i] = -1;
        for (PyMemberDef *m = type->tp_members; m->name; m++)
            if (!strcmp(m->name, name) && m->type == Py_T_OBJECT_EX) out->off[i] = m->offset;
        if (out->off[i] < 0) {
            PyErr_Format(PyExc_TypeError, "%s has no object slot %s", type->tp_name, name);
            return -1;
        }
    }
    return 0;
}

/* An instance of the layout's type with these field values (references stolen; NULL values:
 * an error is set, the others are released). */
PyObject *make_record(const Layout *l, PyObject **values) {
    PyObject *o = NULL;
    int ok = 1;
    for (int i = 0; i < l->n; i++) ok &= values[i] != NULL;
    if (ok) o = l->type->tp_alloc(l->type, 0);
    for (int i = 0; i < l->n; i++) {
        if (o) *(PyObject **)((char *)o + l->off[i]) = values[i];
        else Py_XDECREF(values[i]);
    }
    return o;
}

PyObject *make_match(const Records *r, const Match *m) {
    PyObject *v[4] = {PyLong_FromSsize_t(m->dev), PyLong_FromSsize_t(m->host), PyLong_FromSsize_t(m->disk),
                      PyLong_FromSsize_t(m->inf)};
    return make_record(&r->match, v);
}

PyObject *make_load(const Records *r, long long queued, long long running, long long waiting, double kv) {
    PyObject *v[5] = {PyLong_FromLongLong(queued), PyLong_FromLongLong(running), PyLong_FromLongLong(waiting),
                      PyFloat_FromDouble(kv), Py_NewRef(Py_True)};
    return make_record(&r->load, v);
}

PyObject *make_inputs(const Records *r, PyObject *worker_id, PyObject *match, PyObject *load, double cost,
                      Py_ssize_t candidates) {
    PyObject *v[5] = {Py_NewRef(worker_id), match, load, PyFloat_FromDouble(cost), PyLong_FromSsize_t(candidates)};
    return make_record(&r->inputs, v);
}

int records_init(Records *r, PyObject *spec) {
    PyObject *d, *df, *i, *inf, *m, *mf, *l, *lf;
    if (!PyArg_ParseTuple(spec, "(OO)(OO)(OO)(OO)OOO", &d, &df, &i, &inf, &m, &mf, &l, &lf,
                          &r->policy, &r->local, &r->remote))
        return -1;
    if (layout_of(d, df, &r->decision) < 0 || layout_of(i, inf, &r->inputs) < 0 ||
        layout_of(m, mf, &r->match) < 0 || layout_of(l, lf, &r->load) < 0)
        return -1;
    if (r->decision.n != 9 || r->inputs.n != 5 || r->match.n != 4 || r->load.n != 5) {
        PyErr_SetString(PyExc_TypeError, "record field counts differ from RoutingDecision (9), CostInputs (5), "
                        "MatchInfo (4), WorkerLoad (5): update records.c with them");
        return -1;
    }
    Py_INCREF(r->decision.type); Py_INCREF(r->inputs.type); Py_INCREF(r->match.type); Py_INCREF(r->load.type);
    Py_INCREF(r->policy); Py_INCREF(r->local); Py_INCREF(r->remote);
    r->ready = 1;
    return 0;
}

void records_clear(Records *r) {
    if (!r->ready) return;
    Py_DECREF(r->decision.type); Py_DECREF(r->inputs.type); Py_DECREF(r->match.type); Py_DECREF(r->load.type);
    Py_DECREF(r->policy); Py_DECREF(r->local); Py_DECREF(r->remote);
    r->ready = 0;
}
