# Resource names, hand-written (doc/completions/devlock.zsh): a RESOURCE is
# the name of a lock file in the scratch directory, less its .lock suffix.
# The _devlock_* helpers above it are generated from the clap definitions.

# Prints the resource names in the scratch directory: a --dir DIR among the
# words given, else $DEVLOCK_DIR, else /run/lock/devlock.
_devlock_resources() {
    local dir=${DEVLOCK_DIR:-/run/lock/devlock}
    while (($#)); do
        case $1 in
            --) break ;;
            --dir=*) dir=${1#--dir=} ;;
            --dir) (($# > 1)) && dir=$2 ;;
        esac
        shift
    done
    [[ $dir == "~"* ]] && dir=$HOME${dir#"~"}
    local -a names
    names=("$dir"/*.lock(N.:t:r))
    (($#names)) && print -rl -- $names
    return 0
}

# Offers resource names for a word that is not an option before `--`, at
# the top level or after a subcommand that takes them (devlock status);
# after `--`, the command and then its own arguments, as _precommand does
# for sudo and nice; everything else goes to clap's _devlock.
_devlock_with_resources() {
    local cur=$words[CURRENT] sub= word
    integer i positionals=0 pending=0
    for ((i = 2; i < CURRENT; i++)); do
        if [[ $words[i] == -- ]]; then
            words=("${(@)words[i+1,-1]}")
            ((CURRENT -= i))
            _normal
            return
        fi
    done
    for ((i = 2; i < CURRENT; i++)); do
        word=$words[i]
        if ((pending)); then
            pending=0
        elif [[ $word == -* ]]; then
            _devlock_takes_value "$word" && pending=1
        else
            if ((positionals == 0)) && _devlock_is_subcommand "$word"; then
                sub=$word
            fi
            ((positionals += 1))
        fi
    done
    if ((pending)) || [[ $cur == -* ]] ||
        { [[ -n $sub ]] && ! _devlock_lists_resources "$sub"; }; then
        _devlock "$@"
        return
    fi
    local -a resources subcommands
    resources=(${(f)"$(_devlock_resources "${(@)words[2,CURRENT-1]}")"})
    local ret=1
    compadd -X resource -- $resources && ret=0
    if ((positionals == 0)); then
        subcommands=(${(f)"$(_devlock_subcommands)"})
        compadd -- $subcommands && ret=0
    fi
    return ret
}

# In place of clap's ending: register the wrapper, and when this file runs
# as the autoloaded _devlock, complete the current word with it.
compdef _devlock_with_resources devlock
if [ "$funcstack[1]" = "_devlock" ]; then
    _devlock_with_resources "$@"
fi
