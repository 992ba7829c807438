package gpuctl

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"golang.org/x/oauth2"

	"github.com/gpuplane/gpuplane/contracts"
)

// Login, identity and roles: login stores a token per gateway (see
// Credentials); every other command sends it.

// loginCmd logs in with an API token, an LDAP user name and password, or
// OIDC's device-code flow, checks the result with /v1/whoami and stores
// it. Without a method flag it takes what the gateway offers: OIDC first.
func (a *app) loginCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var token, user, passwordFile string
	var useOIDC bool
	fs.StringVar(&token, "token", "", "an API token (gpt_...); - reads it from stdin")
	fs.StringVar(&user, "user", "", "LDAP user name (the password is read from --password-file or stdin)")
	fs.StringVar(&passwordFile, "password-file", "", "file holding the LDAP password (- for stdin)")
	fs.BoolVar(&useOIDC, "oidc", false, "log in with the identity provider's device-code flow")
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("login", pos, trailing) {
			return ExitUsage
		}
		if a.configDir == "" {
			return a.fail("login", errors.New("no configuration directory to store credentials in; set GPUPLANE_CONFIG_DIR"))
		}
		var cred Credential
		var err error
		switch {
		case token != "" && (user != "" || useOIDC), user != "" && useOIDC:
			return a.usageErr("login", "give one of --token, --user or --oidc")
		case token != "":
			if token == "-" {
				token, err = readSecret(a.stdin)
			}
			cred = Credential{Token: strings.TrimSpace(token), Method: "token"}
		case user != "":
			cred, err = a.ldapLogin(ctx, user, passwordFile)
		default:
			cred, err = a.oidcLogin(ctx, useOIDC)
		}
		if err != nil {
			return a.fail("login", err)
		}
		if cred.Token == "" {
			return a.fail("login", errors.New("empty token"))
		}
		a.token = cred.Token
		c, err := a.api()
		if err != nil {
			return a.fail("login", err)
		}
		who, err := c.WhoAmI(ctx)
		if err != nil {
			return a.fail("login", err)
		}
		cred.Subject, cred.CACert = who.Subject, a.caCert
		if t := tenantOfBindings(who.Bindings); t != "" {
			cred.Tenant = t
		}
		if err := SaveCredential(a.configDir, a.gateway, cred); err != nil {
			return a.fail("login", err)
		}
		fmt.Fprintf(a.stdout, "Logged in to %s as %s (%s); credentials in %s\n", a.gateway, who.Subject,
			bindingsText(who.Bindings), CredentialsFile(a.configDir))
		return ExitOK
	}
}

// tenantOfBindings is the default tenant a login implies: the tenant of
// its only tenant binding.
func tenantOfBindings(bs []contracts.Binding) string {
	var tenants []string
	for _, b := range bs {
		if b.Tenant != "" && !slices.Contains(tenants, b.Tenant) {
			tenants = append(tenants, b.Tenant)
		}
	}
	if len(tenants) == 1 {
		return tenants[0]
	}
	return ""
}

func bindingsText(bs []contracts.Binding) string {
	if len(bs) == 0 {
		return "no roles"
	}
	parts := make([]string, 0, len(bs))
	for _, b := range bs {
		if b.Tenant == "" {
			parts = append(parts, b.Role)
		} else {
			parts = append(parts, b.Role+" of "+b.Tenant)
		}
	}
	return strings.Join(parts, ", ")
}

// readSecret reads one line (a token or password) from r.
func readSecret(r io.Reader) (string, error) {
	line, err := bufio.NewReader(r).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	return strings.TrimRight(line, "\r\n"), nil
}

// ldapLogin exchanges a user name and password for a session token.
func (a *app) ldapLogin(ctx context.Context, user, passwordFile string) (Credential, error) {
	var password string
	var err error
	switch passwordFile {
	case "", "-":
		if passwordFile == "" {
			fmt.Fprintf(a.stderr, "Password for %s: ", user)
		}
		password, err = readSecret(a.stdin)
	default:
		var data []byte
		data, err = os.ReadFile(passwordFile)
		password = strings.TrimRight(string(data), "\r\n")
	}
	if err != nil {
		return Credential{}, fmt.Errorf("reading the password: %w", err)
	}
	c, err := a.api()
	if err != nil {
		return Credential{}, err
	}
	// A login sends no older credentials.
	res, err := c.Login(ctx, user, password)
	if err != nil {
		return Credential{}, err
	}
	return Credential{Token: res.Token, Method: "ldap", ExpiresAt: res.ExpiresAt}, nil
}

// oidcLogin runs OAuth 2.0's device-code flow (RFC 8628) with the issuer
// and client the gateway names, and keeps the ID token, which the gateway
// verifies. asked is whether --oidc was given (else it is the default,
// and its absence is reported with the other methods).
func (a *app) oidcLogin(ctx context.Context, asked bool) (Credential, error) {
	c, err := a.api()
	if err != nil {
		return Credential{}, err
	}
	cfg, err := c.AuthConfig(ctx)
	if err != nil {
		return Credential{}, err
	}
	if cfg.OIDC == nil {
		if asked {
			return Credential{}, errors.New("the gateway accepts no OIDC tokens")
		}
		methods := "--token"
		if cfg.LDAP {
			methods = "--user or --token"
		}
		return Credential{}, fmt.Errorf("the gateway has no OIDC login: use %s", methods)
	}
	octx := oidc.ClientContext(ctx, c.HTTPClient())
	provider, err := oidc.NewProvider(octx, cfg.OIDC.Issuer)
	if err != nil {
		return Credential{}, fmt.Errorf("identity provider %s: %w", cfg.OIDC.Issuer, err)
	}
	oc := oauth2.Config{ClientID: cfg.OIDC.ClientID, Endpoint: provider.Endpoint(), Scopes: cfg.OIDC.Scopes}
	if oc.Endpoint.DeviceAuthURL == "" {
		return Credential{}, fmt.Errorf("identity provider %s offers no device-code flow", cfg.OIDC.Issuer)
	}
	octx = context.WithValue(ctx, oauth2.HTTPClient, c.HTTPClient())
	da, err := oc.DeviceAuth(octx)
	if err != nil {
		return Credential{}, fmt.Errorf("device authorization: %w", err)
	}
	uri := da.VerificationURIComplete
	if uri == "" {
		uri = da.VerificationURI
	}
	fmt.Fprintf(a.stderr, "To log in, open %s and enter the code %s\n", uri, da.UserCode)
	tok, err := oc.DeviceAccessToken(octx, da)
	if err != nil {
		return Credential{}, fmt.Errorf("device login: %w", err)
	}
	idToken, _ := tok.Extra("id_token").(string)
	if idToken == "" {
		return Credential{}, errors.New("the identity provider returned no ID token")
	}
	cred := Credential{Token: idToken, Method: "oidc"}
	if parsed, err := provider.Verifier(&oidc.Config{ClientID: cfg.OIDC.ClientID}).Verify(ctx, idToken); err == nil {
		cred.ExpiresAt = parsed.Expiry
	}
	return cred, nil
}

// logoutCmd forgets the gateway's credentials.
func (a *app) logoutCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("logout", pos, trailing) {
			return ExitUsage
		}
		if err := RemoveCredential(a.configDir, a.gateway); err != nil {
			return a.fail("logout", err)
		}
		fmt.Fprintf(a.stdout, "Logged out of %s\n", a.gateway)
		return ExitOK
	}
}

// whoamiCmd shows who the gateway takes the caller for.
func (a *app) whoamiCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("whoami", pos, trailing) {
			return ExitUsage
		}
		c, err := a.api()
		if err != nil {
			return a.fail("whoami", err)
		}
		who, err := c.WhoAmI(ctx)
		if err != nil {
			return a.fail("whoami", err)
		}
		return a.show(who, func() {
			fmt.Fprintf(a.stdout, "subject: %s\nname:    %s\nmethod:  %s\nroles:   %s\n", who.Subject, who.Name, who.Method, bindingsText(who.Bindings))
		})
	}
}

// tokenCmd is "token create", "token list" and "token revoke ID".
func (a *app) tokenCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var name, role, ttl string
	fs.StringVar(&name, "name", "", "create: what the token is for")
	fs.StringVar(&role, "role", contracts.RoleMember, "create: the token's role (on --tenant unless platform-admin)")
	fs.StringVar(&ttl, "ttl", "", "create: lifetime (Go duration); empty for none")
	return func(ctx context.Context, pos, trailing []string) int {
		usage := `want "token create --name N [--role R] [--tenant T] [--ttl D]", "token list" or "token revoke ID"`
		if len(pos) == 0 || len(trailing) > 0 {
			return a.usageErr("token", "%s", usage)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("token", err)
		}
		switch {
		case pos[0] == "create" && len(pos) == 1:
			if name == "" {
				return a.usageErr("token create", "--name is required")
			}
			res, err := c.CreateToken(ctx, contracts.TokenRequest{Name: name, TTL: ttl, Bindings: []contracts.Binding{a.binding(role)}})
			if err != nil {
				return a.fail("token create", err)
			}
			return a.show(res, func() {
				fmt.Fprintf(a.stdout, "token %s (%s): %s\n", res.Token, bindingsText([]contracts.Binding{a.binding(role)}), res.Secret)
				fmt.Fprintln(a.stderr, "The secret is shown only this once; use it as GPUPLANE_TOKEN or with gpuctl login --token -.")
			})
		case pos[0] == "list" && len(pos) == 1:
			list, err := c.Tokens(ctx)
			if err != nil {
				return a.fail("token list", err)
			}
			return a.show(list, func() {
				tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tKIND\tNAME\tOWNER\tCREATED\tEXPIRES")
				for _, t := range list.Tokens {
					exp := "-"
					if !t.ExpiresAt.IsZero() {
						exp = t.ExpiresAt.Local().Format(time.DateTime)
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", t.ID, t.Kind, t.Name, t.Owner, t.CreatedAt.Local().Format(time.DateTime), exp)
				}
				tw.Flush()
			})
		case pos[0] == "revoke" && len(pos) == 2:
			t, err := c.RevokeToken(ctx, pos[1])
			if err != nil {
				return a.fail("token revoke", err)
			}
			return a.show(t, func() { fmt.Fprintf(a.stdout, "token %s revoked\n", t.ID) })
		}
		return a.usageErr("token", "%s", usage)
	}
}

// binding is role on --tenant (no tenant for platform-admin).
func (a *app) binding(role string) contracts.Binding {
	if role == contracts.RolePlatformAdmin {
		return contracts.Binding{Role: role}
	}
	return contracts.Binding{Role: role, Tenant: a.tenant}
}

// roleCmd is "role bind SUBJECT", "role unbind SUBJECT" and "role list".
func (a *app) roleCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var role string
	var all bool
	fs.StringVar(&role, "role", "", "bind, unbind: platform-admin, tenant-admin, member or viewer (on --tenant)")
	fs.BoolVar(&all, "all", false, "list: every tenant's bindings you may see, not only --tenant's")
	return func(ctx context.Context, pos, trailing []string) int {
		usage := `want "role bind SUBJECT --role R [--tenant T]", "role unbind SUBJECT --role R [--tenant T]" or "role list [--all]"`
		if len(pos) == 0 || len(trailing) > 0 {
			return a.usageErr("role", "%s", usage)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("role", err)
		}
		switch {
		case (pos[0] == "bind" || pos[0] == "unbind") && len(pos) == 2:
			if role == "" {
				return a.usageErr("role "+pos[0], "--role is required")
			}
			b := a.binding(role)
			var rb contracts.RoleBindings
			if pos[0] == "bind" {
				rb, err = c.BindRole(ctx, pos[1], b)
			} else {
				rb, err = c.UnbindRole(ctx, pos[1], b)
			}
			if err != nil {
				return a.fail("role "+pos[0], err)
			}
			return a.show(rb, func() { fmt.Fprintf(a.stdout, "%s: %s\n", rb.Subject, bindingsText(rb.Bindings)) })
		case pos[0] == "list" && len(pos) == 1:
			tenant := a.tenant
			if all {
				tenant = ""
			}
			list, err := c.Roles(ctx, tenant)
			if err != nil {
				return a.fail("role list", err)
			}
			return a.show(list, func() {
				tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "SUBJECT\tROLES")
				for _, rb := range list.Subjects {
					fmt.Fprintf(tw, "%s\t%s\n", rb.Subject, bindingsText(rb.Bindings))
				}
				tw.Flush()
			})
		}
		return a.usageErr("role", "%s", usage)
	}
}
