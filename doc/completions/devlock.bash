# Resource names, hand-written (doc/completions/devlock.bash): a RESOURCE is
# the name of a lock file in the scratch directory, less its .lock suffix.
# The _devlock_* helpers above it are generated from the clap definitions.

# Prints the resource names in the scratch directory: a --dir DIR among the
# words given, else $DEVLOCK_DIR, else /run/lock/devlock.
_devlock_resources() {
    local dir=${DEVLOCK_DIR:-/run/lock/devlock} f
    while (($#)); do
        case $1 in
            --) break ;;
            --dir=*) dir=${1#--dir=} ;;
            --dir) (($# > 1)) && dir=$2 ;;
        esac
        shift
    done
    [[ $dir == "~"* ]] && dir=$HOME${dir#"~"}
    for f in "$dir"/*.lock; do
        [[ -f $f ]] || continue
        f=${f##*/}
        printf '%s\n' "${f%.lock}"
    done
}

# After `--`: the command, then that command's own arguments, the way
# sudo and timeout complete (bash-completion's _comp_command_offset, or
# _command_offset before 2.12); without bash-completion, command names and
# then file names. Returns 1 when there is no `--` before the word.
_devlock_command() {
    local i
    for ((i = 1; i < COMP_CWORD; i++)); do
        [[ ${COMP_WORDS[i]} == -- ]] || continue
        if declare -F _comp_command_offset >/dev/null; then
            _comp_command_offset $((i + 1))
        elif declare -F _command_offset >/dev/null; then
            _command_offset $((i + 1))
        elif ((COMP_CWORD == i + 1)); then
            local IFS=$'\n'
            COMPREPLY=($(compgen -c -- "${COMP_WORDS[COMP_CWORD]}"))
        else
            local IFS=$'\n'
            COMPREPLY=($(compgen -f -- "${COMP_WORDS[COMP_CWORD]}"))
            compopt -o filenames 2>/dev/null
        fi
        return 0
    done
    return 1
}

# Offers resource names for a word that is not an option before `--`, at
# the top level or after a subcommand that takes them (devlock status);
# the command after `--` as above; nothing for a duration or a number;
# everything else goes to clap's _devlock.
_devlock_with_resources() {
    _devlock_command && return 0
    # Words from the line itself: COMP_WORDS splits gpu:0 at the colon.
    local line
    if [[ -n ${COMP_LINE-} ]]; then
        line=${COMP_LINE:0:COMP_POINT}
    else
        printf -v line '%s ' "${COMP_WORDS[@]:0:COMP_CWORD}"
        line+=${COMP_WORDS[COMP_CWORD]}
    fi
    local cur=${line##*[[:space:]]}
    local -a words
    read -ra words <<<"${line:0:${#line}-${#cur}}"
    local sub= word i positionals=0 pending=0 option=
    for ((i = 1; i < ${#words[@]}; i++)); do
        word=${words[i]}
        if ((pending)); then
            pending=0
        elif [[ $word == -* ]]; then
            _devlock_takes_value "$word" && pending=1 option=$word
        else
            if ((positionals == 0)) && _devlock_is_subcommand "$word"; then
                sub=$word
            fi
            ((positionals += 1))
        fi
    done
    if ((pending)) && _devlock_value_is_free "$option"; then
        # 90s, 10m, a count: there is nothing to offer, not even files.
        COMPREPLY=()
        compopt +o default +o bashdefault 2>/dev/null
        return 0
    fi
    if ((pending)) || [[ $cur == -* ]] ||
        { [[ -n $sub ]] && ! _devlock_lists_resources "$sub"; }; then
        _devlock "$@"
        return
    fi
    local candidates
    candidates=$(_devlock_resources "${words[@]}")
    if ((positionals == 0)); then
        candidates+=$'\n'$(_devlock_subcommands)
    fi
    local IFS=$'\n'
    COMPREPLY=($(compgen -W "$candidates" -- "$cur"))
    # Bash replaces only what follows the last colon of gpu:0.
    if [[ $cur == *:* && $COMP_WORDBREAKS == *:* ]]; then
        local colon=${cur%"${cur##*:}"}
        COMPREPLY=("${COMPREPLY[@]#"$colon"}")
    fi
    # No lock file yet: offer nothing rather than file names.
    compopt +o default +o bashdefault 2>/dev/null
    return 0
}

# Replace clap's registration, keeping its options.
if _devlock_spec=$(complete -p devlock 2>/dev/null) && [[ $_devlock_spec == *" -F _devlock "* ]]; then
    eval "${_devlock_spec/ -F _devlock / -F _devlock_with_resources }"
else
    complete -F _devlock_with_resources -o bashdefault -o default devlock
fi
unset _devlock_spec
