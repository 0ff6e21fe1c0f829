/* fc.autocast's construction, __enter__ and __exit__ in C, for the usual call.
 *
 * The Python class in fastcast/autocast.py is the reference: its methods define what
 * autocast does, run wherever this module is not built, and run for every call this
 * module does not take (unusual arguments; any call while an observer is attached to the
 * state manager's observer points). Each step below is the same step as there, in the
 * same order; the cold paths (refusals, warnings, stateful schemes) call the Python
 * functions themselves, so each rule is written once.
 *
 * The contract: `install` takes one table of (role, object) pairs, autocast.native_contract(),
 * and refuses it unless its roles are ROLES below, in order. Everything used here comes
 * from that table as an object (slots as member descriptors, functions, the keyword
 * names): this file looks up no Python name at run time, so a rename on the Python side
 * either changes the table (refused at import) or is carried by it.
 *
 * Why C: a Python class call with keyword arguments builds an argument tuple and a dict
 * and runs a Python __init__, and each Python method adds a frame; together they cost
 * about twice an empty context manager before any work is done.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* The roles of the contract table, in order (exported as _native.ROLES). */
static const char *ROLES[] = {
    "class", "native", "stack", "default_recipe", "shared", "runnable", "recipe_types",
    "observers", "slot_enabled", "slot_recipe", "slot_calibrating", "slot_group", "slot_ran",
    "slot_warning_due", "slot_stateful_threads", "keywords", "py_enter", "py_exit",
    "check_recipe", "refuse_reentry", "exit_out_of_order", "ran_nothing", "levels_exited",
    "not_here",
};
#define NROLES ((Py_ssize_t)(sizeof ROLES / sizeof *ROLES))

static struct {
    PyTypeObject *cls;        /* fastcast.autocast.autocast, the reference class */
    PyTypeObject *native;     /* its subclass whose __enter__/__exit__ are below */
    PyObject *stack;          /* the ContextVar holding [frame, below, token] */
    PyObject *default_recipe; /* schemes.default_recipe */
    PyObject *shared;         /* state.autocast_state (its slots: the two switches) */
    PyObject *runnable;       /* recipe types that passed the support check */
    PyObject *recipe_types;   /* recipe types constructors have seen */
    PyObject *observers;      /* observers.attached: while not empty, Python runs */
    PyObject *kw_enabled, *kw_recipe, *kw_calibrating, *kw_group; /* __init__'s keywords */
    PyObject *py_enter, *py_exit; /* the reference methods */
    PyObject *check_recipe, *refuse_reentry, *exit_out_of_order; /* (self, ...) */
    PyObject *ran_nothing;    /* autocast._ran_nothing(below, stacklevel) */
    PyObject *levels_exited;  /* autocast._levels_exited(frame, below, ok) */
    PyObject *not_here;       /* the message of a foreign token */
    PyObject *ran_descr;      /* AutocastFrame.ran, to set it on any frame */
    /* Slot offsets, from the member descriptors of the table. */
    Py_ssize_t enabled, recipe, calibrating, group, ran, warning_due, stateful_threads;
} N;

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* A slot's value (borrowed), or NULL with AttributeError when it is unset. */
static PyObject *slot(PyObject *obj, Py_ssize_t offset, const char *name) {
    PyObject *value = SLOT(obj, offset);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "fc.autocast: the instance has no %s", name);
    return value;
}

/* Whether an observer is attached: the Python methods (which have the points) run. */
#define OBSERVED() (PyList_GET_SIZE(N.observers) != 0)

/* ----------------------------------------------------------------- construction */

/* The class called in any other way: what calling it would do without this module. */
static PyObject *construct_in_python(PyObject *type, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    PyObject *positional = PyTuple_New(nargs);
    if (positional == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    PyObject *keywords = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        keywords = PyDict_New();
        for (Py_ssize_t i = 0; keywords != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                Py_CLEAR(keywords);
        }
        if (keywords == NULL) {
            Py_DECREF(positional);
            return NULL;
        }
    }
    /* type.__call__ itself: calling the class object again would come back here. */
    PyObject *made = PyType_Type.tp_call(type, positional, keywords);
    Py_DECREF(positional);
    Py_XDECREF(keywords);
    return made;
}

/* autocast(enabled=True, *, recipe=None, calibrating=False, amax_reduction_group=None):
 * the usual call (bools, a recipe type seen before) fills the slots here; anything else
 * goes to the Python __init__, which checks it and explains what is wrong. */
static PyObject *construct(PyObject *type, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *enabled = nargs == 1 ? args[0] : Py_True;
    PyObject *recipe = Py_None, *calibrating = Py_False, *group = Py_None;
    int usual = type == (PyObject *)N.cls && nargs <= 1;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; usual && i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (key == N.kw_recipe)
            recipe = value;
        else if (key == N.kw_calibrating)
            calibrating = value;
        else if (key == N.kw_group)
            group = value;
        else if (key == N.kw_enabled && nargs == 0)
            enabled = value;
        else /* unknown, twice, or a name not interned: Python sorts it out */
            usual = 0;
    }
    if (!usual || !PyBool_Check(enabled) || !PyBool_Check(calibrating))
        return construct_in_python(type, args, nargs, kwnames);
    PyObject *chosen = recipe == Py_None ? PyObject_CallNoArgs(N.default_recipe)
                                         : Py_NewRef(recipe);
    if (chosen == NULL)
        return NULL;
    int seen = PySet_Contains(N.recipe_types, (PyObject *)Py_TYPE(chosen));
    if (seen <= 0) {
        Py_DECREF(chosen);
        return seen < 0 ? NULL : construct_in_python(type, args, nargs, kwnames);
    }
    PyObject *self = N.native->tp_alloc(N.native, 0);
    if (self == NULL) {
        Py_DECREF(chosen);
        return NULL;
    }
    SLOT(self, N.enabled) = Py_NewRef(enabled);
    SLOT(self, N.recipe) = chosen;
    SLOT(self, N.calibrating) = Py_NewRef(calibrating);
    SLOT(self, N.group) = Py_NewRef(group);
    SLOT(self, N.ran) = Py_NewRef(Py_False);
    return self;
}

/* ----------------------------------------------------------------- __enter__ */

static PyObject *enter(PyObject *module, PyObject *self) {
    if (OBSERVED())
        return PyObject_CallOneArg(N.py_enter, self);
    PyObject *recipe = slot(self, N.recipe, "recipe");
    if (recipe == NULL)
        return NULL;
    PyObject *below; /* the stack before this level (a new reference) */
    if (PyContextVar_Get(N.stack, NULL, &below) < 0)
        return NULL;
    if (!PyList_CheckExact(below) || PyList_GET_SIZE(below) != 3) {
        Py_DECREF(below);
        PyErr_SetString(PyExc_RuntimeError, "fc.autocast: the autocast stack is corrupt");
        return NULL;
    }
    int runnable = PySet_Contains(N.runnable, (PyObject *)Py_TYPE(recipe));
    PyObject *checked = runnable != 0 ? Py_NewRef(Py_None)
                                      : PyObject_CallOneArg(N.check_recipe, self);
    if (runnable < 0 || checked == NULL) {
        Py_XDECREF(checked);
        Py_DECREF(below);
        return NULL;
    }
    Py_DECREF(checked);
    /* Nested: refuse self if it is already below (the Python method raises). */
    for (PyObject *level = below; PyList_CheckExact(level) && PyList_GET_SIZE(level) == 3;
         level = PyList_GET_ITEM(level, 1)) {
        if (PyList_GET_ITEM(level, 0) == self) {
            checked = PyObject_CallFunctionObjArgs(N.refuse_reentry, self, below, NULL);
            if (checked != NULL) { /* it raises; never enter twice whatever it did */
                Py_DECREF(checked);
                PyErr_SetString(PyExc_RuntimeError, "fc.autocast: already active here");
            }
            Py_DECREF(below);
            return NULL;
        }
    }
    PyObject *node = PyList_New(3); /* [self, below, token] as in state.Stack */
    if (node == NULL) {
        Py_DECREF(below);
        return NULL;
    }
    PyList_SET_ITEM(node, 0, Py_NewRef(self));
    PyList_SET_ITEM(node, 1, below);
    PyList_SET_ITEM(node, 2, Py_NewRef(Py_None));
    PyObject *token = PyContextVar_Set(N.stack, node);
    if (token == NULL || PyList_SetItem(node, 2, token) < 0) {
        Py_DECREF(node);
        return NULL;
    }
    Py_DECREF(node); /* the context holds it now */
    return Py_NewRef(self);
}

/* ----------------------------------------------------------------- __exit__ */

static PyObject *exit_(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fc.autocast.__exit__ takes 3 arguments");
        return NULL;
    }
    PyObject *self = args[0], *exc_type = args[1];
    if (OBSERVED())
        return PyObject_Vectorcall(N.py_exit, args, 4, NULL);
    PyObject *node;
    if (PyContextVar_Get(N.stack, NULL, &node) < 0)
        return NULL;
    if (!PyList_CheckExact(node) || PyList_GET_SIZE(node) != 3 ||
        PyList_GET_ITEM(node, 0) != self) {
        /* Not the innermost level: the Python method repairs the stack and raises. */
        PyObject *repaired = PyObject_CallFunctionObjArgs(N.exit_out_of_order, self, node, NULL);
        Py_DECREF(node);
        if (repaired == NULL)
            return NULL;
        node = repaired;
    }
    if (PyContextVar_Reset(N.stack, PyList_GET_ITEM(node, 2)) < 0) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) { /* the token of another context */
            PyErr_Clear();
            PyErr_SetObject(PyExc_RuntimeError, N.not_here);
        }
        Py_DECREF(node);
        return NULL;
    }
    PyObject *below = Py_NewRef(PyList_GET_ITEM(node, 1));
    Py_DECREF(node);
    PyObject *result = NULL, *flag;
    PyObject *ran = slot(self, N.ran, "ran"), *enabled = slot(self, N.enabled, "enabled");
    int ran_true = ran == NULL ? -1 : PyObject_IsTrue(ran);
    if (ran_true < 0 || enabled == NULL)
        goto done;
    if (!ran_true) {
        int due = PyObject_IsTrue(enabled);
        if (due > 0) {
            flag = slot(N.shared, N.warning_due, "warning_due");
            due = flag == NULL ? -1 : PyObject_IsTrue(flag);
        }
        if (due < 0)
            goto done;
        if (due) { /* warn from the user's `with` line: one frame less than Python's */
            PyObject *warned = PyObject_CallFunction(N.ran_nothing, "Oi", below, 2);
            if (warned == NULL)
                goto done;
            Py_DECREF(warned);
        }
    } else if (PyList_CheckExact(below) && PyList_GET_ITEM(below, 1) != Py_None) {
        /* nested: what ran here ran inside the levels below too */
        PyObject *frame = PyList_GET_ITEM(below, 0);
        if (Py_TYPE(N.ran_descr)->tp_descr_set(N.ran_descr, frame, Py_True) < 0)
            goto done;
    }
    /* Stateful schemes (delayed scaling) decide whether this level ends the step. */
    flag = slot(N.shared, N.stateful_threads, "stateful_threads");
    int stateful = flag == NULL ? -1 : PyObject_IsTrue(flag);
    if (stateful < 0)
        goto done;
    if (stateful) {
        PyObject *ok = exc_type == Py_None ? Py_True : Py_False;
        PyObject *done_ = PyObject_CallFunctionObjArgs(N.levels_exited, self, below, ok, NULL);
        if (done_ == NULL)
            goto done;
        Py_DECREF(done_);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(below);
    return result;
}

/* ----------------------------------------------------------------- install */

/* The offset of the slot a member descriptor stands for (-1 with TypeError if not one). */
static Py_ssize_t slot_offset(PyObject *descr, PyTypeObject *owner, const char *role) {
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
        !PyType_IsSubtype(owner, PyDescr_TYPE((PyDescrObject *)descr))) {
        PyErr_Format(PyExc_TypeError, "_native.install: %s is not a slot of %s", role,
                     owner->tp_name);
        return -1;
    }
    return ((PyMemberDescrObject *)descr)->d_member->offset;
}

/* The table's entry i, checked to be role ROLES[i] (borrowed; NULL with TypeError). */
static PyObject *entry(PyObject *table, Py_ssize_t i) {
    PyObject *pair = PyTuple_GET_ITEM(table, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) ||
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(pair, 0), ROLES[i]) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "_native.install: entry %zd of the contract must be the role '%s' (the "
                     "Python table and _native.c disagree; see _native.ROLES)", i, ROLES[i]);
        return NULL;
    }
    return PyTuple_GET_ITEM(pair, 1);
}

static PyObject *install(PyObject *module, PyObject *table) {
    if (!PyTuple_Check(table) || PyTuple_GET_SIZE(table) != NROLES) {
        PyErr_Format(PyExc_TypeError, "_native.install: the contract must be a tuple of %zd "
                     "(role, object) pairs (see _native.ROLES)", NROLES);
        return NULL;
    }
    PyObject *v[NROLES];
    for (Py_ssize_t i = 0; i < NROLES; i++)
        if ((v[i] = entry(table, i)) == NULL)
            return NULL;
    if (!PyType_Check(v[0]) || !PyType_Check(v[1]) ||
        !PyType_IsSubtype((PyTypeObject *)v[1], (PyTypeObject *)v[0]) ||
        !(((PyTypeObject *)v[0])->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        PyErr_SetString(PyExc_TypeError, "_native.install: native must subclass class");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)v[0], *shared = Py_TYPE(v[4]);
    PyObject *keywords = v[15];
    if (!PyContextVar_CheckExact(v[2]) || !PySet_CheckExact(v[5]) || !PySet_CheckExact(v[6]) ||
        !PyList_CheckExact(v[7]) || !PyTuple_Check(keywords) || PyTuple_GET_SIZE(keywords) != 4 ||
        !PyUnicode_Check(v[23])) {
        PyErr_SetString(PyExc_TypeError, "_native.install: a contract entry has the wrong type");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < 4; i++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(keywords, i))) {
            PyErr_SetString(PyExc_TypeError, "_native.install: keywords must be 4 str");
            return NULL;
        }
    if ((N.enabled = slot_offset(v[8], cls, ROLES[8])) < 0 ||
        (N.recipe = slot_offset(v[9], cls, ROLES[9])) < 0 ||
        (N.calibrating = slot_offset(v[10], cls, ROLES[10])) < 0 ||
        (N.group = slot_offset(v[11], cls, ROLES[11])) < 0 ||
        (N.ran = slot_offset(v[12], cls, ROLES[12])) < 0 ||
        (N.warning_due = slot_offset(v[13], shared, ROLES[13])) < 0 ||
        (N.stateful_threads = slot_offset(v[14], shared, ROLES[14])) < 0)
        return NULL;
    if (N.cls != NULL) { /* checked after the table: a test may check a table again */
        PyErr_SetString(PyExc_RuntimeError, "fastcast.runtime._native: installed already");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < NROLES; i++)
        Py_INCREF(v[i]); /* for the life of the process */
    N.native = (PyTypeObject *)v[1];
    N.stack = v[2];
    N.default_recipe = v[3];
    N.shared = v[4];
    N.runnable = v[5];
    N.recipe_types = v[6];
    N.observers = v[7];
    N.ran_descr = v[12];
    /* Interned, as the keyword names of a call are: one pointer comparison per keyword. */
    PyObject **kw[4] = {&N.kw_enabled, &N.kw_recipe, &N.kw_calibrating, &N.kw_group};
    for (Py_ssize_t i = 0; i < 4; i++) {
        *kw[i] = Py_NewRef(PyTuple_GET_ITEM(keywords, i));
        PyUnicode_InternInPlace(kw[i]);
    }
    N.py_enter = v[16];
    N.py_exit = v[17];
    N.check_recipe = v[18];
    N.refuse_reentry = v[19];
    N.exit_out_of_order = v[20];
    N.ran_nothing = v[21];
    N.levels_exited = v[22];
    N.not_here = v[23];
    N.cls = cls;
    N.cls->tp_vectorcall = construct;
    Py_RETURN_NONE;
}

/* Whether calling the class takes the C construction (tests run both paths). */
static PyObject *set_fast_construction(PyObject *module, PyObject *on) {
    if (N.cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastcast.runtime._native: not installed");
        return NULL;
    }
    int enable = PyObject_IsTrue(on);
    if (enable < 0)
        return NULL;
    N.cls->tp_vectorcall = enable ? construct : NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_construction(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(N.cls != NULL && N.cls->tp_vectorcall == construct);
}

static PyMethodDef functions[] = {
    {"install", install, METH_O,
     "install(contract): take over the class's construction; contract: a tuple of "
     "(role, object) pairs whose roles are ROLES, in order (autocast.native_contract())"},
    {"set_fast_construction", set_fast_construction, METH_O,
     "Turn the C construction on or off (the Python __init__ runs when off)."},
    {"fast_construction", fast_construction, METH_NOARGS,
     "Whether calling the class takes the C construction."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef enter_def = {"__enter__", (PyCFunction)enter, METH_O,
                                "fc.autocast.__enter__ (C; the Python method is the reference)"};
static PyMethodDef exit_def = {"__exit__", (PyCFunction)(void (*)(void))exit_, METH_FASTCALL,
                               "fc.autocast.__exit__ (C; the Python method is the reference)"};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "fastcast.runtime._native",
    "fc.autocast's construction, __enter__ and __exit__ in C (see _native.c).", -1, functions,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    /* Methods that bind to any instance they are looked up on (instancemethod), for the
     * subclass's class body: __enter__ = _native.enter. */
    PyObject *functions_[2] = {PyCFunction_New(&enter_def, NULL), PyCFunction_New(&exit_def, NULL)};
    const char *names[2] = {"enter", "exit"};
    for (int i = 0; i < 2; i++) {
        PyObject *method = functions_[i] ? PyInstanceMethod_New(functions_[i]) : NULL;
        Py_XDECREF(functions_[i]);
        if (method == NULL || PyModule_AddObject(module, names[i], method) < 0) {
            Py_XDECREF(method);
            Py_DECREF(module);
            return NULL;
        }
    }
    PyObject *roles = PyTuple_New(NROLES);
    for (Py_ssize_t i = 0; roles != NULL && i < NROLES; i++) {
        PyObject *name = PyUnicode_FromString(ROLES[i]);
        if (name == NULL)
            Py_CLEAR(roles);
        else
            PyTuple_SET_ITEM(roles, i, name);
    }
    if (roles == NULL || PyModule_AddObject(module, "ROLES", roles) < 0) {
        Py_XDECREF(roles);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
